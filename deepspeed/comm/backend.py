"""``deepspeed.comm.backend``: the torch.distributed backend (implemented in deepspeed/_core/comm/backend.py)."""

from __future__ import annotations

from typing import Any

from deepspeed._core.comm import backend as _backend
from deepspeed._core.comm.backend import (  # noqa: F401
    FAKE_BACKEND,
    ProcessGroup,
    TorchBackend,
    Work,
    is_available,
    to_torch_op,
    torch_dist_initialized,
)


def __getattr__(name: str) -> Any:
    # Module state (which teardown is registered) is read from the implementation at access time.
    return getattr(_backend, name)
