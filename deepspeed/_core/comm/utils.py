"""Launcher-environment helpers and comms-logger argument helpers (no torch.distributed here)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

# Upstream keeps these two in deepspeed/constants.py; here they are the comm package's own defaults (the launcher's
# port is the same number: deepspeed/launcher/constants.py).
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
default_pg_timeout = timedelta(minutes=int(os.environ.get("DEEPSPEED_TIMEOUT", "10")))


def _first_int_env(names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return default


def get_local_rank_from_launcher() -> int:
    """Local rank exported by torchrun/deepspeed (``LOCAL_RANK``) or Open MPI; 0 when neither is set."""
    return _first_int_env(("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"), 0)


def get_world_rank_from_launcher() -> int:
    """Global rank exported by the launcher (``RANK`` or Open MPI); 0 when neither is set."""
    return _first_int_env(("RANK", "OMPI_COMM_WORLD_RANK"), 0)


def get_world_size_from_launcher() -> int:
    """World size exported by the launcher (``WORLD_SIZE`` or Open MPI); 1 when neither is set."""
    return _first_int_env(("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"), 1)


def get_caller_func(frame: int = 3) -> str:
    """Name of the function ``frame`` levels up the stack (used as the comms-logger debug tag)."""
    import sys

    return sys._getframe(frame).f_code.co_name


def get_default_args(func: Callable[..., Any]) -> dict[str, Any]:
    """Keyword defaults of ``func`` (so the logger sees ``log_name`` even when the caller omitted it)."""
    signature = inspect.signature(func)
    return {k: v.default for k, v in signature.parameters.items() if v.default is not inspect.Parameter.empty}


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def get_msg_size_from_args(func: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Bytes moved by a collective call: the largest tensor (or tensor list) among its arguments.

    Taking the largest makes gather-style verbs report the full gathered size and scatter-style verbs the full
    input size, which is the size bus-bandwidth formulas expect.
    """
    sizes = [_nbytes(a) for a in args] + [_nbytes(v) for v in kwargs.values()]
    return max(sizes, default=0)


def get_debug_log_name(func_args: dict[str, Any], debug: bool) -> str:
    """Logger record name: ``log_name``, suffixed with the caller when debug logging is on."""
    name = func_args.get("log_name", "unknown")
    if debug and func_args.get("debug"):
        return f"{name} | [Caller Func: {func_args['debug']}]"
    return name
