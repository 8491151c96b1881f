"""ZeRO-3 under non-reentrant activation checkpointing: nothing stays gathered behind the backward.

PyTorch's non-reentrant checkpoint stops its recompute early, by raising out of the last module whose
saved tensors it needs. That module's forward post-hook must still run (it releases the gathered
parameters); otherwise every checkpointed layer leaves its last module gathered until the backward ends.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests._harness import run_distributed

LAYERS = 6


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda t: t + self.down(torch.tanh(self.up(t))), x, use_reentrant=False)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Block() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _alive_in_backward(world: int) -> dict:
    import deepspeed

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,
            "reduce_bucket_size": 10_000,
            # Per-submodule units: the early stop happens inside a block, between its modules' hooks.
            "lean_block_fetch_units": False,
        },
    }
    engine, *_ = deepspeed.initialize(model=_Net(), config=cfg)
    manager = engine.zero3_manager
    for step in range(2):
        manager.boundary_samples = [] if step == 1 else None
        loss = engine(torch.randn(2, 16, generator=torch.Generator().manual_seed(step)))
        engine.backward(loss)
        engine.step()
    samples = [s for s in manager.boundary_samples if s.event in ("pre_backward", "post_backward")]
    after = manager.count_gathered().units_alive
    engine.destroy()
    return {"max_alive_in_backward": max(s.units_alive for s in samples), "n": len(samples), "after": after}


def test_early_stopped_recompute_releases_its_last_module() -> None:
    for r in run_distributed(_alive_in_backward, 2, 2):
        assert r["n"] >= 2 * 2 * LAYERS  # every Linear's backward was observed
        # The current module, at most one neighbour being recomputed; never one per finished layer.
        assert r["max_alive_in_backward"] <= 2, r
        assert r["after"] == 0
