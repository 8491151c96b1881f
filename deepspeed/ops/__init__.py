"""Native ops and the optimizers built on them (``deepspeed.ops.adam``, ``.adagrad``, ``.lion``, ``.op_builder``) and
the asynchronous file I/O op (``deepspeed.ops.aio``).

Submodules are imported on access so ``import deepspeed.ops`` stays cheap.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["adagrad", "adam", "aio", "flatten", "lion", "op_builder"]


def __getattr__(name: str) -> ModuleType:
    if name in __all__:
        return importlib.import_module(f"deepspeed.ops.{name}")
    raise AttributeError(f"module 'deepspeed.ops' has no attribute {name!r}")
