"""Input forms of a DeepSpeed config: a dict, a JSON/hjson file, a raw JSON string or urlsafe-base64 JSON."""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Any

import hjson

from deepspeed._core.config.base import DeepSpeedConfigError, dict_raise_error_on_duplicate_keys

__all__ = ["load_config_dict"]


def load_config_dict(config: str | os.PathLike | dict) -> dict:
    """Return the config as a dict.

    Args:
        config: a dict (returned as is, not copied: the engine exposes it as ``engine.config``); a path to a
            JSON/hjson file (duplicate keys rejected); a urlsafe-base64 encoded JSON string; or a raw JSON
            object string (the form HF Transformers and Accelerate also accept).

    Raises:
        DeepSpeedConfigError: the input is none of those, or it does not parse to a JSON object.
    """
    if isinstance(config, dict):
        return config
    if isinstance(config, os.PathLike):
        return _read_config_file(os.fspath(config))
    if isinstance(config, str):
        if os.path.isfile(config):
            return _read_config_file(config)
        return _decode_config_string(config)
    raise DeepSpeedConfigError(
        "DeepSpeed config must be a dict, a path to a JSON/hjson file, or a (base64) JSON "
        f"string; got {type(config).__name__}"
    )


def _read_config_file(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        # hjson accepts plain JSON plus comments and relaxed syntax, as upstream does.
        parsed = hjson.loads(text, object_pairs_hook=dict_raise_error_on_duplicate_keys)
    except DeepSpeedConfigError as err:
        raise DeepSpeedConfigError(f"DeepSpeed config file '{path}': {err}") from err
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DeepSpeedConfigError(f"DeepSpeed config file '{path}' is not valid JSON/hjson: {err}") from err
    return _require_object(parsed, f"DeepSpeed config file '{path}'")


def _decode_config_string(text: str) -> dict:
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            return _require_object(
                json.loads(stripped, object_pairs_hook=dict_raise_error_on_duplicate_keys), "DeepSpeed config string"
            )
        except json.JSONDecodeError as err:
            raise DeepSpeedConfigError(f"DeepSpeed config string looks like JSON but does not parse: {err}") from err
    try:
        decoded = base64.urlsafe_b64decode(stripped.encode("ascii")).decode("utf-8")
        parsed = json.loads(decoded, object_pairs_hook=dict_raise_error_on_duplicate_keys)
    except (binascii.Error, UnicodeError, ValueError) as err:
        if stripped.endswith((".json", ".hjson", ".conf")) or os.sep in stripped:
            raise DeepSpeedConfigError(f"DeepSpeed config file not found: '{text}'") from err
        raise DeepSpeedConfigError(
            "DeepSpeed config string is neither an existing file path, a JSON object, nor "
            f"urlsafe-base64 encoded JSON: {text[:80]!r}"
        ) from err
    return _require_object(parsed, "decoded base64 DeepSpeed config")


def _require_object(parsed: Any, origin: str) -> dict:
    if not isinstance(parsed, dict):
        raise DeepSpeedConfigError(f"{origin} must hold a JSON object at the top level; got {type(parsed).__name__}")
    return parsed
