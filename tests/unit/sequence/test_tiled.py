"""Tiled compute against the untiled computation: values, input and weight gradients, the ZeRO flag protocol."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepspeed._core.sequence import tiled
from deepspeed.runtime.sequence_parallel.ulysses_sp import (
    AutogradComputeMLP,
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)

HIDDEN, INTER, VOCAB = 8, 24, 11


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.intermediate_size = INTER
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=True)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)


def mlp_fn(module: MLP, x: torch.Tensor) -> torch.Tensor:
    return module.plain(x)


def loss_sum(module: Head, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    logits = module.lm_head(x).float()
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="none", ignore_index=-100)
    if mask is not None:
        per_token = per_token * mask.reshape(-1)
    return per_token.sum()


def loss_mean(module: Head, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(module.lm_head(x).float().view(-1, VOCAB), y.view(-1))


def _grads(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    out = [x.grad.clone()]
    out += [p.grad.clone() for p in module.parameters()]
    return out


def _zero(module: nn.Module, x: torch.Tensor) -> None:
    module.zero_grad(set_to_none=True)
    x.grad = None


def _assert_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shards", [1, 3, 4, 7])  # seqlen 12: 3 and 4 divide it, 7 does not
def test_tiled_mlp_matches_untiled(shards: int) -> None:
    torch.manual_seed(0)
    mlp = MLP()
    x = torch.randn(2, 12, HIDDEN, requires_grad=True)
    upstream_grad = torch.randn(2, 12, HIDDEN)
    ref = mlp.plain(x)
    ref.backward(upstream_grad)
    expected = [ref.detach(), *_grads(mlp, x)]
    _zero(mlp, x)
    out = TiledMLP.apply(mlp_fn, mlp, x, shards, list(mlp.parameters()))
    out.backward(upstream_grad)
    _assert_close([out.detach(), *_grads(mlp, x)], expected)


def test_tiled_mlp_keeps_only_one_tile_of_intermediate() -> None:
    """The function sees tiles of at most ceil(rows / shards) rows, in forward and in backward."""
    torch.manual_seed(0)
    mlp = MLP()
    seen: list[int] = []

    def fn(module: MLP, x: torch.Tensor) -> torch.Tensor:
        seen.append(x.reshape(-1, HIDDEN).shape[0])
        return module.plain(x)

    x = torch.randn(1, 10, HIDDEN, requires_grad=True)
    TiledMLP.apply(fn, mlp, x, 4, []).sum().backward()
    assert seen == [3, 3, 3, 1] * 2


def test_autograd_compute_mlp_matches_untiled() -> None:
    torch.manual_seed(0)
    mlp = MLP()
    x = torch.randn(2, 5, HIDDEN, requires_grad=True)
    mlp.plain(x).pow(2).sum().backward()
    expected = _grads(mlp, x)
    _zero(mlp, x)
    AutogradComputeMLP.apply(mlp_fn, mlp, x).pow(2).sum().backward()
    _assert_close(_grads(mlp, x), expected)


def _loss_case(seed: int = 0) -> tuple[Head, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    head = Head()
    x = torch.randn(2, 9, HIDDEN, requires_grad=True)
    y = torch.randint(0, VOCAB, (2, 9))
    return head, x, y


@pytest.mark.parametrize("shards", [1, 2, 3, 5, 18])  # 18 rows: 2, 3 and 18 divide them, 5 does not
def test_tiled_loss_sum_with_masked_labels_matches_untiled(shards: int) -> None:
    head, x, y = _loss_case()
    y[0, :4] = -100  # ignored labels
    mask = (torch.rand(2, 9) > 0.3).float()
    ref = loss_sum(head, x, y, mask)
    ref.backward()
    expected = [ref.detach(), *_grads(head, x)]
    _zero(head, x)
    loss = TiledFusedLogitsLoss.apply(loss_sum, head, x, y, mask, shards, [head.lm_head.weight], "sum")
    loss.backward()
    _assert_close([loss.detach(), *_grads(head, x)], expected)


@pytest.mark.parametrize("shards", [2, 3, 6])  # tiles of equal size: the mean of tile means is the mean
def test_tiled_loss_mean_matches_untiled(shards: int) -> None:
    head, x, y = _loss_case(1)
    ref = loss_mean(head, x, y)
    ref.backward()
    expected = [ref.detach(), *_grads(head, x)]
    _zero(head, x)
    loss = TiledFusedLogitsLoss.apply(loss_mean, head, x, y, None, shards, head.parameters(), "mean")
    loss.backward()
    _assert_close([loss.detach(), *_grads(head, x)], expected)


def test_tiled_loss_mean_is_the_mean_of_tile_outputs() -> None:
    """Uneven tiles (18 rows in 4 tiles: 5, 5, 5, 3): the result is the mean of the four tile losses."""
    head, x, y = _loss_case(2)
    rows_x, rows_y = x.reshape(-1, HIDDEN), y.reshape(-1)
    bounds = [(0, 5), (5, 10), (10, 15), (15, 18)]
    ref = torch.stack([loss_mean(head, rows_x[a:b], rows_y[a:b]) for a, b in bounds]).mean()
    ref.backward()
    expected = [ref.detach(), *_grads(head, x)]
    _zero(head, x)
    loss = TiledFusedLogitsLoss.apply(loss_mean, head, x, y, None, 4, [], "mean")
    loss.backward()
    _assert_close([loss.detach(), *_grads(head, x)], expected)


@pytest.mark.parametrize("scale", [0.25, 3.0])
def test_scaling_the_tiled_loss_scales_every_gradient(scale: float) -> None:
    head, x, y = _loss_case(3)
    loss_sum(head, x, y).backward()
    expected = [g * scale for g in _grads(head, x)]
    _zero(head, x)
    loss = TiledFusedLogitsLoss.apply(loss_sum, head, x, y, None, 3, [head.lm_head.weight], "sum")
    (loss * scale).backward()
    _assert_close(_grads(head, x), expected)


def test_tiled_loss_without_grad_needs_no_backward() -> None:
    head, x, y = _loss_case(4)
    with torch.no_grad():
        loss = TiledFusedLogitsLoss.apply(loss_sum, head, x, y, None, 4, [], "sum")
    torch.testing.assert_close(loss, loss_sum(head, x, y).detach())
    assert not loss.requires_grad


def _flag_log(params: list[nn.Parameter]) -> list[list[bool]]:
    log: list[list[bool]] = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda q: log.append([q.ds_grad_is_ready]))
    return log


def test_flag_protocol_every_tile_but_the_last_says_not_ready() -> None:
    head, x, y = _loss_case(5)
    weight = head.lm_head.weight
    log = _flag_log([weight])
    TiledFusedLogitsLoss.apply(loss_sum, head, x, y, None, 5, [weight], "sum").backward()
    # 18 rows in tiles of 4: five tiles, the gradient accumulated five times, ready only at the last.
    assert log == [[False]] * 4 + [[True]]
    mlp = MLP()
    log = _flag_log([mlp.down_proj.weight])
    xm = torch.randn(1, 9, HIDDEN, requires_grad=True)
    TiledMLP.apply(mlp_fn, mlp, xm, 4, list(mlp.parameters())).sum().backward()
    assert log == [[False]] * 2 + [[True]]  # 9 rows in tiles of 3: three tiles although 4 were asked for


def _seq_fn(hidden: torch.Tensor, labels: torch.Tensor, head: Head) -> torch.Tensor:
    return loss_sum(head, hidden, labels)


@pytest.mark.parametrize("shards", [2, 4])  # seqlen 9: neither divides it
def test_sequence_tiled_compute_loss_per_tile(shards: int) -> None:
    head, x, y = _loss_case(6)
    ref = loss_sum(head, x, y)
    ref.backward()
    expected = [ref.detach(), *_grads(head, x)]
    _zero(head, x)
    out = sequence_tiled_compute(
        _seq_fn,
        9,
        shards,
        {"hidden": x, "labels": y},
        {"head": head},
        "hidden",
        [head.lm_head.weight],
        output_unshard_dimension=0,
        output_reduction="sum",
    )
    out.backward()
    _assert_close([out.detach(), *_grads(head, x)], expected)


def test_sequence_tiled_compute_unreduced_and_mean_outputs() -> None:
    torch.manual_seed(7)
    mlp = MLP()
    x = torch.randn(2, 7, HIDDEN, requires_grad=True)
    probe = torch.randn(2, 7, HIDDEN)
    (mlp.plain(x) * probe).sum().backward()
    expected = _grads(mlp, x)
    _zero(mlp, x)
    out = sequence_tiled_compute(lambda x, m: m.plain(x), 7, 3, {"x": x}, {"m": mlp}, "x", None, 1, None)
    torch.testing.assert_close(out, mlp.plain(x))
    (out * probe).sum().backward()
    _assert_close(_grads(mlp, x), expected)
    _zero(mlp, x)
    mean = sequence_tiled_compute(lambda x, m: m.plain(x), 7, 3, {"x": x}, {"m": mlp}, "x")
    torch.testing.assert_close(mean, mlp.plain(x).mean())
    mean.backward()
    _zero(mlp, x)
    mlp.plain(x).mean().backward()
    expected = _grads(mlp, x)
    _zero(mlp, x)
    sequence_tiled_compute(lambda x, m: m.plain(x), 7, 3, {"x": x}, {"m": mlp}, "x").backward()
    _assert_close(_grads(mlp, x), expected)
    assert SequenceTiledCompute is not None


def test_auto_shards_follow_the_budget() -> None:
    tiled.set_auto_tile_budget(3 * VOCAB * 4 * 5)  # five rows of logits work per tile
    try:
        head, x, y = _loss_case(8)
        seen: list[int] = []

        def fn(module: Head, xt: torch.Tensor, yt: torch.Tensor) -> torch.Tensor:
            seen.append(xt.shape[0])
            return loss_sum(module, xt, yt)

        loss = TiledFusedLogitsLoss.apply(fn, head, x, y, None, "auto", [head.lm_head.weight], "sum")
        torch.testing.assert_close(loss, loss_sum(head, x, y).detach())
        assert seen == [5, 5, 5, 3]  # 18 rows, ceil(18 / 5) = 4 tiles
        tiled.set_auto_tile_budget(3 * INTER * 4 * 4)  # four MLP rows per tile (fp32)
        mlp, rows = MLP(), []
        xm = torch.randn(1, 8, HIDDEN)
        TiledMLP.apply(lambda m, t: rows.append(t.shape[-2]) or m.plain(t), mlp, xm, "auto", [])
        assert rows == [4, 4]
    finally:
        tiled.set_auto_tile_budget(None)
    assert tiled.auto_tile_budget() >= 1 << 24


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"output_reduction": "max"}, "output_reduction='max'"),
        ({"shards": 0}, "shards must be a positive integer or 'auto', got 0"),
        ({"shards": "many"}, "got 'many'"),
        ({"y": torch.zeros(2, 8, dtype=torch.long)}, r"agree on \[batch, seqlen\]"),
        ({"x": torch.zeros(18), "y": torch.zeros(18, dtype=torch.long)}, "at least 2-D"),
        ({"mask": torch.ones(2, 9, 1)}, "mask must be 2-D"),
    ],
)
def test_tiled_loss_bad_input(kwargs: dict, match: str) -> None:
    head, x, y = _loss_case()
    args = {"x": x, "y": y, "mask": None, "shards": 2, "output_reduction": "sum", **kwargs}
    with pytest.raises(ValueError, match=match):
        TiledFusedLogitsLoss.apply(
            loss_sum, head, args["x"], args["y"], args["mask"], args["shards"], [], args["output_reduction"]
        )


def test_sequence_tiled_compute_bad_input() -> None:
    head, x, y = _loss_case()
    with pytest.raises(ValueError, match="valid values are None, 'mean', 'sum'"):
        sequence_tiled_compute(_seq_fn, 9, 2, {"hidden": x, "labels": y}, {"head": head}, "hidden", None, 0, "max")
    with pytest.raises(ValueError, match="'missing' is not one of"):
        sequence_tiled_compute(_seq_fn, 9, 2, {"hidden": x, "labels": y}, {"head": head}, "missing")
    with pytest.raises(ValueError, match="shards='auto' is not supported here"):
        sequence_tiled_compute(_seq_fn, 9, "auto", {"hidden": x, "labels": y}, {"head": head}, "hidden")
    with pytest.raises(ValueError, match="auto tile budget must be a positive number"):
        tiled.set_auto_tile_budget(0)
