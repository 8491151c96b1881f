"""Converting a gradient range into the step's dtype and scaling it (unscale and clip) in one pass."""

from __future__ import annotations

import torch

CONVERT_BLOCK_NUMEL = 1 << 20
"""Host conversions are scaled 4 MiB (fp32) at a time, while the block is still in cache."""


Coef = float | torch.Tensor
"""A gradient coefficient (unscale × clip): a host float, or a 0-d tensor on the gradients' device when the step
is decided there ([Note: device step] in ``deepspeed/_core/optim/sharded.py``)."""


def scales(coef: Coef) -> bool:
    """Whether multiplying by ``coef`` can change a gradient (a device coefficient is never read on the host)."""
    return torch.is_tensor(coef) or coef != 1.0


def convert_scaled(out: torch.Tensor, src: torch.Tensor, coef: Coef) -> None:
    """``out = src.to(out.dtype) * coef``, the product taken in ``out``'s dtype.

    On the host, converting a whole chunk and then scaling it reads and writes the fp32 chunk twice from memory;
    done block by block the scaling pass hits the cache.
    """
    block_numel = CONVERT_BLOCK_NUMEL
    if not scales(coef) or out.device.type != "cpu" or out.numel() <= block_numel:
        out.copy_(src)
        if scales(coef):
            out.mul_(coef)
        return
    for start in range(0, out.numel(), block_numel):
        block = out[start : start + block_numel]
        block.copy_(src[start : start + block.numel()])
        block.mul_(coef)


__all__ = ["CONVERT_BLOCK_NUMEL", "Coef", "convert_scaled", "scales"]
