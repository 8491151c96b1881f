"""Multi-tensor flatten / unflatten into caller-provided flat buffers.

``flatten_into`` copies tensors into slices of ``out``; ``unflatten_from`` copies the slices back.
CUDA inputs use the one-launch kernel from ``UtilsBuilder`` when it is built (it is JIT-compiled on
first use); everything else uses torch (``torch._foreach_copy_`` over slice views), and one log
line says so. Both paths validate the same way and raise ``ValueError`` on bad input.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from deepspeed._foundation.logging import logger

_state: dict[str, ModuleType | None | bool] = {"module": None, "tried": False}
_logged: set[str] = set()


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logger.info(f"deepspeed.ops.flatten: using the torch implementation ({reason})")


def _cuda_kernel() -> ModuleType | None:
    """The built utils module when it carries the CUDA kernel, else ``None`` (tried once)."""
    if not _state["tried"]:
        _state["tried"] = True
        from deepspeed.ops.op_builder import UtilsBuilder

        builder = UtilsBuilder()
        if not builder.uses_cuda() or not builder.is_compatible():
            _log_once(f"CUDA kernel not buildable: {builder.error_log or '; '.join(builder.cuda_reasons())}")
            return None
        try:
            module = builder.load()
        except Exception as err:  # noqa: BLE001 (a failed build must not take training down with it)
            _log_once(f"building the utils op failed: {err}")
            return None
        _state["module"] = module if module.has_cuda_kernel() else None
    return _state["module"]  # type: ignore[return-value]


def packed_offsets(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Element offsets that place ``tensors`` back to back from 0."""
    offsets, next_offset = [], 0
    for t in tensors:
        offsets.append(next_offset)
        next_offset += t.numel()
    return offsets


def _validate(op: str, tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int]) -> None:
    if not flat.is_contiguous():
        raise ValueError(f"{op}: the flat buffer must be contiguous")
    if len(offsets) != len(tensors):
        raise ValueError(f"{op}: got {len(offsets)} offsets for {len(tensors)} tensors")
    capacity = flat.numel()
    for i, (t, off) in enumerate(zip(tensors, offsets, strict=True)):
        if t.device != flat.device:
            raise ValueError(
                f"{op}: tensor {i} is on {t.device} but the flat buffer is on {flat.device} (mixed devices)"
            )
        if t.dtype != flat.dtype:
            raise ValueError(f"{op}: tensor {i} has dtype {t.dtype} but the flat buffer has {flat.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: tensor {i} is not contiguous")
        if off < 0 or off + t.numel() > capacity:
            raise ValueError(
                f"{op}: tensor {i} with {t.numel()} elements at offset {off} does not fit "
                f"in a flat buffer of {capacity} elements"
            )


def _slices(
    tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    flat1d = flat.view(-1)
    pairs = [
        (flat1d.narrow(0, off, t.numel()), t.view(-1)) for t, off in zip(tensors, offsets, strict=True) if t.numel() > 0
    ]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _use_kernel(flat: torch.Tensor) -> ModuleType | None:
    if flat.device.type != "cuda":
        _log_once(f"inputs on {flat.device.type}, the kernel is CUDA-only")
        return None
    return _cuda_kernel()


def flatten_into(
    tensors: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int] | None = None
) -> torch.Tensor:
    """Copy each tensor into ``out`` starting at its element offset (packed from 0 by default).

    Args:
        tensors: contiguous tensors on ``out``'s device with ``out``'s dtype.
        out: contiguous flat buffer; only the target slices are written.
        offsets: element offset of each tensor in ``out``.

    Returns:
        ``out``.
    """
    offsets = packed_offsets(tensors) if offsets is None else list(offsets)
    # Validate in Python first, for both paths: see docs/ops.md "Known issues" on C++-side checks.
    _validate("flatten_into", tensors, out, offsets)
    kernel = _use_kernel(out)
    if kernel is not None:
        return kernel.flatten_into(list(tensors), out, offsets)
    dst, src = _slices(tensors, out, offsets)
    if dst:
        torch._foreach_copy_(dst, src)
    return out


def unflatten_from(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int] | None = None) -> None:
    """Copy the slices of ``flat`` at ``offsets`` (packed from 0 by default) back into ``tensors``."""
    offsets = packed_offsets(tensors) if offsets is None else list(offsets)
    _validate("unflatten_from", tensors, flat, offsets)
    kernel = _use_kernel(flat)
    if kernel is not None:
        kernel.unflatten_from(flat, list(tensors), offsets)
        return
    src, dst = _slices(tensors, flat, offsets)
    if dst:
        torch._foreach_copy_(dst, src)
