"""Enforce the config-surface table (``surface.py``) on a validated config, and warn about unknown top-level keys.

:func:`enforce_surface` runs inside ``DeepSpeedConfig(...)``, which the engine builds first thing on every rank,
so a refused key fails every rank alike before any collective. Keys accepted without effect log one warning per
key per process; unknown top-level keys one warning per run (first rank only) with the nearest valid key.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

from deepspeed._core.config.base import DeepSpeedConfigError, accepted_keys, model_keys, unknown_key_message
from deepspeed._core.config.surface import RAW_BLOCKS, SURFACE, Verdict, judge
from deepspeed._foundation.logging import logger

_warned: set[str] = set()
"""Keys already warned about in this process."""


def _flatten(model: BaseModel | None, prefix: str, given_only: bool) -> Iterator[tuple[str, Any]]:
    if model is None:
        return
    names = model.model_fields_set if given_only else type(model).model_fields
    for name in names:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            yield from _flatten(value, f"{prefix}{name}.", given_only)
        else:
            yield f"{prefix}{name}", value


def _raw_given(param_dict: dict) -> Iterator[tuple[str, Any]]:
    """Raw upstream blocks as judged: ``block.key`` where the table names it, the rest under ``block``."""
    for block in RAW_BLOCKS:
        if block not in param_dict:
            continue
        value = param_dict[block]
        if isinstance(value, dict):
            rest = {}
            for key, item in value.items():
                if f"{block}.{key}" in SURFACE:
                    yield f"{block}.{key}", item
                else:
                    rest[key] = item
            if rest or not value:
                yield block, rest
        else:
            yield block, value


def enforce_surface(root: BaseModel, param_dict: dict) -> None:
    """Raise for refused keys, warn once per process for keys set to a value that has no effect.

    Args:
        root: the validated top-level model (``RootConfig``).
        param_dict: the user's dict, for the blocks accepted without a model.

    Raises:
        DeepSpeedConfigError: listing every refused key with its block and what is supported.
    """
    warn_unknown_top_level(type(root), param_dict)
    given = dict(_flatten(root, "", given_only=True))
    given.update(_raw_given(param_dict))
    _apply(judge(given, dict(model_keys(type(root))), dict(_flatten(root, "", given_only=False))))


def enforce_block_surface(block: BaseModel, prefix: str) -> None:
    """:func:`enforce_surface` for one validated block built outside a whole config.

    The ZeRO façades that integrations construct without the engine turn their upstream keyword arguments into a
    ``zero_optimization`` block; this gives those arguments the refusals and no-effect warnings the same keys get in
    a config.

    Args:
        block: the validated block model.
        prefix: its dotted place in a config, with the trailing dot (``"zero_optimization."``).
    """
    _apply(
        judge(
            dict(_flatten(block, prefix, given_only=True)),
            dict(model_keys(type(block), prefix)),
            dict(_flatten(block, prefix, given_only=False)),
        )
    )


def _apply(verdict: Verdict) -> None:
    if verdict.refusals:
        raise DeepSpeedConfigError("; ".join(verdict.refusals))
    for key in verdict.no_effect:
        if key not in _warned:
            _warned.add(key)
            logger.warning(f"{key} is accepted but has no effect in deepspeed-lean: {SURFACE[key].note}")


def warn_unknown_top_level(root_cls: type[BaseModel], param_dict: dict) -> None:
    """Warn once per run about top-level keys the root model neither models nor tolerates, with a "did you mean"
    hint. Every rank reads the config, so only the first rank warns; a key already warned about stays quiet."""
    valid = accepted_keys(root_cls)
    tolerated: frozenset[str] = getattr(root_cls, "tolerated_keys", frozenset())
    unknown = [key for key in param_dict if key not in valid and key not in tolerated]
    fresh = [key for key in unknown if f"unknown:{key}" not in _warned]
    if not fresh:
        return
    _warned.update(f"unknown:{key}" for key in fresh)
    if _first_rank():
        logger.warning(
            f"DeepSpeed config (top level): ignoring {unknown_key_message(fresh, valid | tolerated, list_valid=False)}"
        )


def _first_rank() -> bool:
    # Imported lazily, as in batch.py: the config is read before (or without) an initialised process group, where
    # the launcher's RANK says which process this is.
    try:
        from deepspeed._core.comm import dist
    except ImportError:
        return os.environ.get("RANK", "0").strip() in ("", "0")
    is_initialized = getattr(dist, "is_initialized", None)
    if callable(is_initialized) and is_initialized():
        return int(dist.get_rank()) == 0
    return os.environ.get("RANK", "0").strip() in ("", "0")
