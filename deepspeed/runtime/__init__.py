"""``deepspeed.runtime``: engine, config and ZeRO façades (upstream import paths)."""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    """Resolve submodules on attribute access: accelerate reads ``deepspeed.runtime.lr_schedules.X``
    as an attribute chain, which fails when ``deepspeed.runtime`` was imported before ``lr_schedules``."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
