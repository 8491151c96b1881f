"""The FLOPs profiler counts element-wise work (activations, norms, softmax, dropout, arithmetic, pooling,
upsampling) by the documented formulas, as flops without MACs, and a transformer block's total is the sum of its
parts."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepspeed.profiling.flops_profiler import FlopsProfiler, get_module_flops, get_module_macs

X = (2, 4, 6, 6)  # batch, channels, height, width
N = 2 * 4 * 6 * 6


def _profile(model: nn.Module, *inputs: torch.Tensor, training: bool = False) -> tuple[int, int]:
    """(flops, MACs) of one forward of ``model`` in training or eval mode."""
    model.train(training)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(*inputs)
    prof.stop_profile()
    flops, macs = int(prof.get_total_flops()), int(prof.get_total_macs())
    prof.end_profile()
    return flops, macs


class _Fn(nn.Module):
    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)


@pytest.mark.parametrize(
    "module",
    [
        nn.ReLU(),
        nn.ReLU(inplace=True),
        nn.GELU(),
        nn.GELU(approximate="tanh"),
        nn.SiLU(),
        nn.Sigmoid(),
        nn.Tanh(),
        nn.ELU(),
        nn.LeakyReLU(),
        nn.ReLU6(),
        nn.PReLU(),
        nn.Hardswish(),
        nn.Softmax(dim=-1),
        nn.LogSoftmax(dim=1),
    ],
    ids=lambda m: type(m).__name__,
)
def test_activations_and_softmax_count_one_flop_per_element(module: nn.Module) -> None:
    assert _profile(module, torch.randn(X)) == (N, 0)


@pytest.mark.parametrize(
    ("module", "training", "per_element"),
    [
        (nn.LayerNorm(6), False, 5),
        (nn.LayerNorm(6, elementwise_affine=False), False, 4),
        (nn.GroupNorm(2, 4), False, 5),
        (nn.GroupNorm(2, 4, affine=False), False, 4),
        (nn.BatchNorm2d(4), True, 5),
        (nn.BatchNorm2d(4, affine=False), True, 4),
        (nn.BatchNorm2d(4), False, 2),
        (nn.BatchNorm2d(4, affine=False), False, 1),
        (nn.InstanceNorm2d(4), False, 4),
        (nn.InstanceNorm2d(4, affine=True), False, 5),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else str(v),
)
def test_normalisation_counts(module: nn.Module, training: bool, per_element: int) -> None:
    assert _profile(module, torch.randn(X), training=training) == (per_element * N, 0)


@pytest.mark.parametrize("affine", [True, False])
def test_rms_norm_counts_the_same_fused_or_composed(affine: bool) -> None:
    rows = 2 * 4 * 6
    expected = N * (4 if affine else 3) + rows  # square, mean, scale (+ weight); one rsqrt per row
    composed = nn.RMSNorm(6, elementwise_affine=affine)
    assert _profile(composed, torch.randn(X)) == (expected, 0)
    weight = torch.ones(6) if affine else None
    fused = _Fn(lambda x: torch.ops.aten._fused_rms_norm(x, [6], weight, 1e-6)[0])
    assert _profile(fused, torch.randn(X)) == (expected, 0)


def test_dropout_counts_its_multiply_only_while_training() -> None:
    assert _profile(nn.Dropout(0.25), torch.randn(X), training=True) == (N, 0)
    assert _profile(nn.Dropout(0.25), torch.randn(X), training=False) == (0, 0)
    # The fused kernel some devices run: the same count.
    fused = _Fn(lambda x: torch.ops.aten.native_dropout(x, 0.25, True)[0])
    assert _profile(fused, torch.randn(X)) == (N, 0)
    assert _profile(_Fn(lambda x: torch.ops.aten.native_dropout(x, 0.25, False)[0]), torch.randn(X)) == (0, 0)


def test_arithmetic_counts_the_broadcast_result() -> None:
    a, row = torch.randn(X), torch.randn(6)
    for fn in (torch.add, torch.sub, torch.mul, torch.div, lambda x, y: x + y, lambda x, y: y / x):
        assert _profile(_Fn(fn), a, row) == (N, 0)
    assert _profile(_Fn(lambda x, y: 1.0 - x * 2), a, row) == (2 * N, 0)  # rsub and mul by a scalar
    assert _profile(_Fn(lambda x, y: torch.rsqrt(x.pow(2).mean(-1))), a, row) == (N + N + N // 6, 0)
    assert _profile(_Fn(lambda x, y: x.sum()), a, row) == (N, 0)


def test_in_place_and_integer_arithmetic_are_not_counted() -> None:
    assert _profile(_Fn(lambda x: x.clone().add_(1).mul_(2)), torch.randn(X)) == (0, 0)
    assert _profile(_Fn(lambda i: i * 3 + 1), torch.arange(10)) == (0, 0)


def test_embedding_counts_nothing() -> None:
    assert _profile(nn.Embedding(11, 8), torch.randint(0, 11, (3, 5))) == (0, 0)


@pytest.mark.parametrize(
    "module",
    [
        nn.MaxPool2d(2),
        nn.AvgPool2d(3, stride=1),
        nn.AdaptiveAvgPool2d(1),
        nn.AdaptiveAvgPool2d(2),
        nn.AdaptiveMaxPool2d(3),
        nn.MaxPool3d(2),
        _Fn(lambda x: F.max_pool1d(x.flatten(2), 3)),
        _Fn(lambda x: F.avg_pool1d(x.flatten(2), 2)),
    ],
    ids=lambda m: type(m).__name__,
)
def test_pooling_counts_one_flop_per_input_element(module: nn.Module) -> None:
    assert _profile(module, torch.randn(X)) == (N, 0)


@pytest.mark.parametrize(
    ("module", "out_elements"),
    [
        (nn.Upsample(scale_factor=2, mode="nearest"), 4 * N),
        (nn.Upsample(size=(9, 7), mode="bilinear"), 2 * 4 * 9 * 7),
        (nn.Upsample(scale_factor=3, mode="bicubic"), 9 * N),
        (_Fn(lambda x: F.interpolate(x, size=(8, 8), mode="nearest-exact")), 2 * 4 * 8 * 8),
    ],
    ids=["nearest", "bilinear", "bicubic", "nearest-exact"],
)
def test_upsampling_counts_one_flop_per_output_element(module: nn.Module, out_elements: int) -> None:
    assert _profile(module, torch.randn(X)) == (out_elements, 0)


def test_fused_attention_counts_its_two_matrix_products() -> None:
    batch, heads, seq_q, seq_k, dim, dim_v = 2, 3, 5, 7, 8, 8
    q, k = torch.randn(batch, heads, seq_q, dim), torch.randn(batch, heads, seq_k, dim)
    v = torch.randn(batch, heads, seq_k, dim_v)
    macs = batch * heads * seq_q * seq_k * (dim + dim_v)  # QK^T and PV
    assert _profile(_Fn(F.scaled_dot_product_attention), q, k, v) == (2 * macs, macs)


class _Block(nn.Module):
    """A pre-norm transformer block: attention then an MLP, each with dropout and a residual add."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(b, s, d)))
        return x + self.drop(self.fc2(self.act(self.fc1(self.ln2(x)))))


@pytest.mark.parametrize("training", [True, False])
def test_transformer_block_total_is_the_sum_of_its_ops(training: bool) -> None:
    b, s, d, heads, hidden = 2, 5, 16, 2, 32
    block = _Block(d, heads, hidden).train(training)
    prof = FlopsProfiler(block)
    prof.start_profile()
    block(torch.randn(b, s, d))
    prof.stop_profile()
    tokens = b * s
    matmul_macs = {"qkv": tokens * d * 3 * d, "proj": tokens * d * d, "fc1": tokens * d * hidden}
    matmul_macs["fc2"] = tokens * hidden * d
    attention_macs = b * s * s * d * 2  # QK^T and PV over all heads
    elementwise = {"ln1": 5 * tokens * d, "ln2": 5 * tokens * d, "act": tokens * hidden}
    elementwise["drop"] = 2 * tokens * d if training else 0  # called twice
    residual_adds = 2 * tokens * d
    for name, macs in matmul_macs.items():
        sub = getattr(block, name)
        assert (get_module_flops(sub), get_module_macs(sub)) == (2 * macs, macs), name
    for name, flops in elementwise.items():
        sub = getattr(block, name)
        assert (get_module_flops(sub), get_module_macs(sub)) == (flops, 0), name
    assert block.__flops__ == 2 * attention_macs + residual_adds  # the block's own ops
    total_macs = sum(matmul_macs.values()) + attention_macs
    assert prof.get_total_macs() == total_macs
    assert prof.get_total_flops() == 2 * total_macs + sum(elementwise.values()) + residual_adds
    prof.end_profile()


class _Recurrent(nn.Module):
    def __init__(self, rnn: nn.RNNBase | nn.RNNCellBase) -> None:
        super().__init__()
        self.rnn, self.head = rnn, nn.Linear(rnn.hidden_size * 2, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.rnn(x)
        return self.head(out[0] if isinstance(out, tuple) else out.repeat(1, 2))


def _layer(gates: int, inputs: int, hidden: int, gate_arithmetic: int) -> tuple[int, int]:
    """(flops, MACs) of one step of one layer: two biased products, then the gates' arithmetic."""
    macs = gates * (inputs + hidden)
    return 2 * macs - 2 * gates + 2 * gates + gate_arithmetic * hidden, macs


def test_recurrent_modules_are_counted_per_step_by_their_hook() -> None:
    hidden = 16
    lstm = nn.LSTM(8, hidden, num_layers=2, bidirectional=True, batch_first=True)
    steps = 3 * 5
    layers = [_layer(4 * hidden, 8, hidden, 10), _layer(4 * hidden, 2 * hidden, hidden, 10)]
    flops, macs = (2 * steps * sum(c[i] for c in layers) for i in (0, 1))
    head = 3 * 5 * 2 * hidden * 3
    assert _profile(_Recurrent(lstm), torch.randn(3, 5, 8)) == (flops + 2 * head, macs + head)
    # A cell runs as separate kernels on this device: counted once, by its hook, not also by its kernels.
    cell_flops, cell_macs = _layer(3 * hidden, 8, hidden, 7)
    head = 4 * 2 * hidden * 3
    assert _profile(_Recurrent(nn.GRUCell(8, hidden)), torch.randn(4, 8)) == (
        4 * cell_flops + 2 * head,
        4 * cell_macs + head,
    )
