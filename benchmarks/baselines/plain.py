"""A speed floor, not an engine: the model trained by plain PyTorch on one device, with no wrapper at all.

The weights are bf16 and torch AdamW (fused) steps them directly, after ``clip_grad_norm_(1.0)``: no fp32 master,
no gathers, no gradient hooks, no conversion. Every engine measured beside it keeps an fp32 master and so does at
least this row's device work (its numerics differ; it is never compared for loss). Its step time is what the
model's own kernels and the framework's dispatch cost: a ratio to FSDP2 below this row's is out of any engine's
reach on the same model and batch. One rank only.
"""

from __future__ import annotations

from typing import Any

import torch

from _harness import TorchLoopTrainer


class PlainTrainer(TorchLoopTrainer):
    """The bare model in :class:`~_harness.TorchLoopTrainer`'s loop; one rank only."""

    name = "plain"

    def __init__(self, model: torch.nn.Module, spec: dict) -> None:
        if int(spec.get("world_size", 1)) != 1:
            raise ValueError("the plain PyTorch floor runs on one rank only")
        super().__init__(model, spec)

    def info(self) -> dict[str, Any]:
        optimizer = "torch.optim.AdamW (fused on CUDA) on the bf16 weights, no engine"
        return {"optimizer_class": optimizer, "skipped_steps": 0}
