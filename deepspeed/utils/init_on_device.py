"""``OnDevice``: build a model directly on a device (``"meta"`` for shape-only construction)."""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch


class OnDevice:
    """Context manager: tensors created inside land on ``device`` with floating dtype ``dtype``.

    Args:
        dtype: default floating dtype while active (``None`` keeps the current one).
        device: target device, e.g. ``"meta"`` or ``"cuda:0"``.
        enabled: ``False`` makes the context a no-op.
    """

    def __init__(self, dtype: torch.dtype | None, device: Any = "meta", enabled: bool = True) -> None:
        self.dtype = dtype
        self.device = torch.device(device)
        self.enabled = enabled
        self._device_ctx: Any = None
        self._saved_dtype: torch.dtype | None = None

    def __enter__(self) -> OnDevice:
        if self.enabled:
            self._device_ctx = torch.device(self.device)
            self._device_ctx.__enter__()
            if self.dtype is not None:
                self._saved_dtype = torch.get_default_dtype()
                torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.enabled:
            if self._saved_dtype is not None:
                torch.set_default_dtype(self._saved_dtype)
            self._device_ctx.__exit__(exc_type, exc, tb)
