"""Tiled MLP and tiled logits+loss under ZeRO-0/1/2/3 (world 2): gradients equal a single-process untiled model's.

The tiles accumulate each compute parameter's gradient several times within one backward; the engines' gradient
hooks must wait for ``ds_grad_is_ready`` ([Note: ds_grad_is_ready]) or they reduce a partial gradient (ZeRO-1/2
with small buckets lose the later tiles; ZeRO-3 hands the parameter over once per tile). A head tied to the input
embedding must get both shares of its gradient.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._harness import run_distributed

VOCAB, HIDDEN, INTER, SEQ, MICRO = 29, 12, 20, 9, 2


class TiledLM(nn.Module):
    """Embedding, one residual MLP, a (tied or untied) head; ``tiles=None`` computes everything untiled."""

    def __init__(self, tied: bool, tiles: int | None) -> None:
        super().__init__()
        self.tiles = tiles
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def loss_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(x).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="sum")

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP

        h = self.embed(tokens)
        if self.tiles is None:
            h = h + self.mlp(h)
            return self.loss_sum(h, labels) / labels.numel()
        mlp_params = [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, self.down_proj.bias]
        h = h + TiledMLP.apply(TiledLM.mlp, self, h, self.tiles, mlp_params)
        loss = TiledFusedLogitsLoss.apply(
            TiledLM.loss_sum, self, h, labels, None, self.tiles, [self.head.weight], "sum"
        )
        return loss / labels.numel()


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g), torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 64,  # buckets of one or two parameters: a partial gradient would start alone
            "allgather_bucket_size": 64,
            "stage3_param_persistence_threshold": 0,
        },
    }


def _reference_grads(tied: bool, world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TiledLM(tied, tiles=None)
    total: dict[str, torch.Tensor] = {}
    for rank in range(world):
        model.zero_grad()
        model(*_batch(rank)).backward()
        for name, p in model.named_parameters():
            total[name] = total.get(name, 0) + p.grad.detach() / world
    return total


def _engine_grads(stage: int, tied: bool, tiles: int) -> dict:
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.utils.tensor_fragment import safe_get_full_grad

    torch.manual_seed(0)
    model = TiledLM(tied, tiles)
    engine = deepspeed.initialize(model=model, config=_config(stage))[0]
    arrivals: dict[str, int] = {}
    manager = getattr(engine.optimizer, "manager", None)
    if manager is not None:
        names = {id(p): n for n, p in engine.module.named_parameters()}
        manager.on_grad_ready(
            lambda p, state, grad: arrivals.__setitem__(names[id(p)], arrivals.get(names[id(p)], 0) + 1)
        )
    engine.backward(engine(*_batch(dist.get_rank())))
    grads = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"grads": grads, "arrivals": arrivals}


def _check(stage: int, tied: bool, tiles: int) -> None:
    results = run_distributed(_engine_grads, 2, stage, tied, tiles)
    expected = _reference_grads(tied, 2)
    for result in results:
        assert set(result["grads"]) == set(expected)
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6, msg=f"stage {stage} {name}")
    if stage == 3:
        # Every tiled parameter is handed to the reducer once per backward, with its whole gradient.
        for name in ("gate_proj.weight", "up_proj.weight", "down_proj.weight", "down_proj.bias"):
            assert results[0]["arrivals"][name] == 1, results[0]["arrivals"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tiled_gradients_exact_at_every_stage(stage: int) -> None:
    _check(stage, tied=False, tiles=4)  # 18 rows: tiles of 5, 5, 5, 3


def test_tied_head_under_tiled_loss_gets_whole_gradient_at_zero3() -> None:
    _check(3, tied=True, tiles=3)


def test_reference_model_is_tiling_invariant() -> None:
    """The single-process check the parity relies on: tiled and untiled compute the same gradients."""
    torch.manual_seed(0)
    plain = TiledLM(True, None)
    tiled = copy.deepcopy(plain)
    tiled.tiles = 4
    batch = _batch(0)
    plain(*batch).backward()
    tiled(*batch).backward()
    for (name, a), b in zip(plain.named_parameters(), tiled.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def _auto_counts(rows_per_rank: list[int]) -> int:
    from deepspeed import comm as dist
    from deepspeed._core.sequence import tiled

    tiled.set_auto_tile_budget(1000)
    try:
        return tiled.auto_shards(rows_per_rank[dist.get_rank()], 100)  # ten rows per tile
    finally:
        tiled.set_auto_tile_budget(None)


def test_auto_shard_count_is_agreed_over_ranks() -> None:
    """Ranks with different local lengths run the same number of tiles (the largest), so ZeRO-3 gathers match."""
    assert run_distributed(_auto_counts, 2, [35, 61]) == [7, 7]
