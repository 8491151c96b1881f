"""``deepspeed.utils.nvtx``: mark a function's calls as ranges in the accelerator's profiler timeline."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from deepspeed.accelerator import get_accelerator

F = TypeVar("F", bound=Callable[..., Any])


def instrument_w_nvtx(func: F) -> F:
    """Decorate ``func`` so that each call is one named range (NVTX on CUDA; a no-op where the accelerator has none)."""

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        accelerator = get_accelerator()
        accelerator.range_push(func.__qualname__)
        try:
            return func(*args, **kwargs)
        finally:
            accelerator.range_pop()

    return wrapped  # type: ignore[return-value]
