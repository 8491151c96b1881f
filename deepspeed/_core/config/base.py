"""Base pydantic model and small helpers shared by every DeepSpeed config block.

Every JSON block that DeepSpeed validates with pydantic derives from :class:`DeepSpeedConfigModel`. The base
class owns the input rules that integrations depend on, so each block only declares its fields:

* a field whose value is the string ``"auto"`` is dropped before validation (the default is used), because
  HF Transformers / Accelerate leave ``"auto"`` placeholders they did not fill;
* deprecated fields are declared with ``json_schema_extra={"deprecated": True, "new_param": ..., ...}``; the
  old key logs a warning and its value is carried over to the replacement field;
* unknown keys raise :class:`DeepSpeedConfigError` naming the key, the block and the nearest valid key;
* every validation failure is re-raised as :class:`DeepSpeedConfigError` (a ``ValueError``) whose message names
  the dotted key path, so users see ``zero_optimization.reduce_bucket_size`` rather than a pydantic dump.
"""

from __future__ import annotations

import collections.abc
import difflib
import json
import typing
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, model_validator

from deepspeed._foundation.logging import logger

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11

AUTO = "auto"
"""Placeholder value HF integrations use for "fill me in"; dropped before validation."""

_STRICT_CONTEXT_KEY = "ds_strict"
_MESSAGE_PREFIX = "Invalid DeepSpeed config: "


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config value is missing, malformed or inconsistent; the message names the key."""


class pp_int(int):
    """An ``int`` that prints with thousands separators (or a custom label) in config dumps."""

    _label: str | None

    def __new__(cls, value: float, custom_print_str: str | None = None) -> pp_int:
        obj = super().__new__(cls, value)
        obj._label = custom_print_str
        return obj

    def __repr__(self) -> str:
        return self._label if self._label else f"{int(self):,}"


def nearest_key(key: str, candidates: collections.abc.Iterable[str]) -> str | None:
    """Return the candidate closest to ``key`` (difflib ratio), or ``None`` when nothing is close."""
    matches = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def accepted_keys(model_cls: type[BaseModel]) -> set[str]:
    keys: set[str] = set()
    for name, info in model_cls.model_fields.items():
        keys.add(name)
        if info.alias:
            keys.add(info.alias)
    return keys


def _present_key(data: dict, model_cls: type[BaseModel], field_name: str) -> str | None:
    """Which spelling (alias or field name) of ``field_name`` the user wrote, if any."""
    info = model_cls.model_fields[field_name]
    for key in (info.alias, field_name):
        if key is not None and key in data:
            return key
    return None


def unknown_key_message(unknown: list[str], valid: set[str], list_valid: bool) -> str:
    parts, unmatched = [], False
    for key in unknown:
        guess = nearest_key(key, valid)
        unmatched = unmatched or guess is None
        parts.append(f"'{key}'" + (f" (did you mean '{guess}'?)" if guess else ""))
    message = f"unknown key(s) {', '.join(parts)}"
    # The full key list is long; show it only when no close match could be suggested.
    return message + (f"; valid keys are {sorted(valid)}" if list_valid and unmatched else "")


class DeepSpeedConfigModel(BaseModel):
    """Base of every pydantic DeepSpeed config block (upstream class name and semantics).

    Args:
        strict: when True, ``"auto"`` values are kept (and then usually fail validation) instead of being
            dropped. Upstream spelling of the switch.
        **data: the block's JSON keys; field names and aliases are both accepted.
    """

    model_config = ConfigDict(
        validate_default=True,
        validate_assignment=True,
        use_enum_values=True,
        populate_by_name=True,
        extra="forbid",
        arbitrary_types_allowed=True,
        protected_namespaces=(),
        use_attribute_docstrings=True,
    )

    config_block: ClassVar[str] = ""
    """JSON name of this block, used to prefix error messages (empty for the top level)."""

    def __init__(self, strict: bool = False, **data: Any) -> None:
        self._validate_into(data, strict)

    @classmethod
    def from_dict(cls, data: collections.abc.Mapping, strict: bool = False) -> Self:
        """Validate a block given as a mapping (any keys, even ``strict``) and return the model."""
        obj = cls.__new__(cls)
        obj._validate_into(dict(data), strict)
        return obj

    def _validate_into(self, data: dict, strict: bool) -> None:
        try:
            self.__pydantic_validator__.validate_python(data, self_instance=self, context={_STRICT_CONTEXT_KEY: strict})
        except ValidationError as err:
            raise DeepSpeedConfigError(describe_validation_error(err, self.config_block)) from err

    @classmethod
    def _rewrite_legacy_input(cls, data: dict) -> dict:
        """Hook for blocks that accept a legacy shape of their input; identity by default."""
        return data

    @model_validator(mode="before")
    @classmethod
    def _prepare_input(cls, data: Any, info: ValidationInfo) -> Any:
        # Runs for nested blocks as well as the outermost one, so "auto" dropping, unknown-key hints and
        # deprecations behave the same at every depth. (Pydantic builds nested blocks through their own
        # __init__, without our context, so strict=True applies to the outermost block only, as upstream.)
        if not isinstance(data, collections.abc.Mapping) or info.field_name is not None:
            # field_name is set only for validate_assignment, where data holds every current field value;
            # input rewriting applies to user-given blocks, not to assignments.
            return data
        data = cls._rewrite_legacy_input(dict(data))
        strict = bool(info.context and info.context.get(_STRICT_CONTEXT_KEY))
        if not strict:
            data = _drop_auto_values(cls, data)
        _check_unknown_keys(cls, data)
        return _apply_deprecations(cls, data)


class DeepSpeedLenientConfigModel(DeepSpeedConfigModel):
    """Base for blocks upstream reads key by key, where unknown keys are ignored (with a warning) rather than
    rejected: ``activation_checkpointing``, ``flops_profiler``, ``checkpoint``, ``data_types``, ``aio``."""

    model_config = ConfigDict(extra="ignore")

    tolerated_keys: ClassVar[frozenset[str]] = frozenset()
    """Keys ignored without a warning (known upstream keys this package does not model)."""

    warns_unknown_keys: ClassVar[bool] = True
    """Whether validation itself warns about unknown keys (the root leaves it to ``enforce.py``: once per run)."""


def _drop_auto_values(model_cls: type[BaseModel], data: dict) -> dict:
    dropped = [key for key, value in data.items() if isinstance(value, str) and value == AUTO]
    if dropped:
        block = getattr(model_cls, "config_block", "") or model_cls.__name__
        logger.info(f"DeepSpeed config '{block}': dropping 'auto' value(s) for {dropped}; defaults are used")
    return {key: value for key, value in data.items() if key not in dropped}


def _check_unknown_keys(model_cls: type[BaseModel], data: dict) -> None:
    valid = accepted_keys(model_cls)
    unknown = [key for key in data if key not in valid]
    if not unknown:
        return
    if model_cls.model_config.get("extra") == "forbid":
        # Raised as ValueError so pydantic attaches the location; the outer __init__ names the block.
        raise ValueError(unknown_key_message(unknown, valid, list_valid=True))
    if not getattr(model_cls, "warns_unknown_keys", True):
        return
    silent: collections.abc.Container[str] = getattr(model_cls, "tolerated_keys", frozenset())
    noisy = [key for key in unknown if key not in silent]
    if noisy:
        block = getattr(model_cls, "config_block", "") or "top level"
        logger.warning(f"DeepSpeed config ({block}): ignoring {unknown_key_message(noisy, valid, list_valid=False)}")


def _apply_deprecations(model_cls: type[BaseModel], data: dict) -> dict:
    for name, info in model_cls.model_fields.items():
        extra = info.json_schema_extra
        if not isinstance(extra, dict) or not extra.get("deprecated"):
            continue
        old_key = _present_key(data, model_cls, name)
        if old_key is None:
            continue
        new_param = str(extra.get("new_param", ""))
        hint = f"; use {new_param} instead" if new_param else ""
        logger.warning(f"Config parameter {old_key} is deprecated{hint}")
        if not new_param or not extra.get("set_new_param", True):
            continue
        if _present_key(data, model_cls, new_param) is not None:
            raise ValueError(
                f"'{old_key}' is deprecated and cannot be given together with its replacement "
                f"'{new_param}'; keep only '{new_param}'"
            )
        convert = extra.get("new_param_fn")  # pydantic types the extra as JSON; upstream puts a function here
        data[new_param] = convert(data[old_key]) if callable(convert) else data[old_key]
    return data


def describe_validation_error(err: ValidationError, block: str) -> str:
    """Turn a pydantic ``ValidationError`` into one readable line per problem, each naming its key path."""
    lines = []
    for problem in err.errors():
        inner = problem.get("ctx", {}).get("error")
        if isinstance(inner, DeepSpeedConfigError):
            # A nested block's own __init__ already produced a fully qualified message (pydantic calls a
            # custom __init__ for nested models too); keep it rather than prefixing the path twice.
            lines.append(str(inner).removeprefix(_MESSAGE_PREFIX))
            continue
        path = ".".join([block] * bool(block) + [str(part) for part in problem["loc"]])
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden":
            message = "unknown key"
        elif problem["type"] not in ("value_error", "assertion_error"):
            message = f"{message} (got {problem.get('input')!r})"
        lines.append(f"{path or '<config>'}: {message}")
    return _MESSAGE_PREFIX + "; ".join(lines)


def get_scalar_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]`` or the default (upstream helper for non-pydantic blocks)."""
    return param_dict.get(param_name, param_default_value)


def get_list_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    """Same as :func:`get_scalar_param`; kept for upstream callers."""
    return param_dict.get(param_name, param_default_value)


def get_dict_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    """Same as :func:`get_scalar_param`; kept for upstream callers."""
    return param_dict.get(param_name, param_default_value)


def dict_raise_error_on_duplicate_keys(ordered_pairs: list[tuple[str, Any]]) -> dict:
    """JSON ``object_pairs_hook`` that rejects an object repeating a key (silently last-wins otherwise)."""
    result: dict = {}
    for key, value in ordered_pairs:
        if key in result:
            raise DeepSpeedConfigError(f"Duplicate key in DeepSpeed config: '{key}'")
        result[key] = value
    return result


class ScientificNotationEncoder(json.JSONEncoder):
    """JSON encoder used for config dumps (upstream name); objects it cannot encode are written via ``repr``."""

    def default(self, o: Any) -> Any:
        """Fallback for non-JSON values (enums, paths, dtypes): their ``repr``."""
        return repr(o)


class DeepSpeedConfigObject:
    """Plain object whose ``repr`` is its attributes as JSON (upstream base of non-pydantic configs)."""

    def repr(self) -> dict:
        """The attributes as a dict."""
        return self.__dict__

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4, cls=ScientificNotationEncoder)


def submodel(annotation: Any) -> type[BaseModel] | None:
    """The pydantic block class a field holds (``X`` or ``X | None``), or ``None`` for a plain value."""
    for arg in typing.get_args(annotation) or (annotation,):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def model_keys(model_cls: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every dotted leaf key of ``model_cls`` (nested blocks walked), with its default."""
    for name, info in model_cls.model_fields.items():
        block = submodel(info.annotation)
        if block is not None:
            yield from model_keys(block, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", info.get_default(call_default_factory=True)
