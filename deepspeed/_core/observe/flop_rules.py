"""Flop formulas for the work ``torch.utils.flop_counter.FlopCounterMode`` does not count by itself.

PyTorch's counter knows the matrix kernels (matrix products, convolutions, fused attention). The DeepSpeed profile
also counts element-wise work, each op as a number of flops on its tensors' sizes (``n`` = elements of the input):

* activations (ReLU, GELU, SiLU, sigmoid, tanh, ELU, leaky ReLU, ReLU6, PReLU, ...): ``n``;
* softmax and log-softmax: ``n``;
* layer norm, group norm, and batch/instance norm while training: ``5n`` with an affine weight, ``4n`` without;
  batch norm in eval mode: ``2n`` with a weight, ``n`` without; RMS norm: the square, the mean, the scaling (and
  the weight, ``3n`` or ``4n``) plus one reciprocal square root per normalised row;
* dropout while training: ``n`` (the multiply by the scaled mask); in eval mode nothing runs;
* out-of-place arithmetic on floating tensors (``+ - * /``, ``pow``, ``sqrt``, ``rsqrt``, ``exp``, ``log``, ...):
  the elements of the (broadcast) result; reductions ``sum``/``mean``: the elements reduced. In-place forms
  (``x += y``) are not counted: kernels built of other kernels use them for their internal bookkeeping;
* pooling: ``n``; upsampling/interpolation: the elements of the output; embedding lookups: nothing;
* recurrent modules (RNN, GRU, LSTM and their cells) by a per-step estimate (:func:`recurrent_counts`), taken from a
  forward hook on the module rather than from the kernels it runs, which differ by device.

These are estimates of the element-wise work, not a model of each kernel. They add flops but no multiply-accumulates:
a module's MACs stay the matrix work (half the flops of the ops in :data:`MATMUL_OPS`).

The formulas are handed to ``FlopCounterMode(custom_mapping=...)`` by :func:`counter_mapping`; they receive the op's
real arguments and output (``_get_raw``) so that they can read training flags and dtypes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

aten = torch.ops.aten
Formula = Callable[..., int]


def _tensor(value: Any) -> torch.Tensor | None:
    """The tensor of an op's argument or output (the first of a tuple, as for ``native_layer_norm``'s)."""
    if isinstance(value, (tuple, list)) and value:
        value = value[0]
    return value if isinstance(value, torch.Tensor) else None


def _numel(value: Any) -> int:
    tensor = _tensor(value)
    return int(tensor.numel()) if tensor is not None else 0


def _is_float(value: Any) -> bool:
    tensor = _tensor(value)
    return tensor is not None and (tensor.is_floating_point() or tensor.is_complex())


def _raw(formula: Formula) -> Formula:
    """Mark ``formula`` to get the op's tensors rather than their shapes (``FlopCounterMode``'s ``_get_raw``)."""
    formula._get_raw = True  # type: ignore[attr-defined]
    return formula


@_raw
def _input_elements(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return _numel(args[0])


@_raw
def _output_elements(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return _numel(out_val)


@_raw
def _float_output_elements(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
    # Integer arithmetic (positions, indices) is address computation, not floating-point work.
    return _numel(out_val) if _is_float(out_val) else 0


@_raw
def _float_input_elements(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return _numel(args[0]) if _is_float(args[0]) else 0


def _norm_flops(elements: int, affine: bool) -> int:
    return elements * (5 if affine else 4)


@_raw
def _layer_norm(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
    # native_layer_norm(input, normalized_shape, weight, bias, eps)
    return _norm_flops(_numel(args[0]), len(args) > 2 and args[2] is not None)


@_raw
def _group_norm(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
    # native_group_norm(input, weight, bias, N, C, HxW, group, eps)
    return _norm_flops(_numel(args[0]), args[1] is not None)


def _batch_norm(training: bool | None) -> Formula:
    """Batch norm whose training flag is ``training``, or the first boolean argument when ``None``."""

    @_raw
    def formula(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        train = training
        if train is None:
            train = next((a for a in args if isinstance(a, bool)), bool(kwargs.get("training", True)))
        elements, affine = _numel(args[0]), len(args) > 1 and args[1] is not None
        if train:
            return _norm_flops(elements, affine)
        return elements * (2 if affine else 1)

    return formula


@_raw
def _rms_norm(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
    # _fused_rms_norm(input, normalized_shape, weight, eps): square, mean, scale (+ weight) per element and one
    # reciprocal square root per row: what the unfused composite (pow, mean, rsqrt, mul) is counted as.
    elements = _numel(args[0])
    rows = elements // max(math.prod(args[1]), 1)
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    return elements * (4 if weight is not None else 3) + rows


@_raw
def _dropout(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
    # native_dropout(input, p, train): train=None means training.
    train = args[2] if len(args) > 2 else kwargs.get("train")
    return 0 if train is False else _numel(args[0])


@_raw
def _attention(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """The two matrix products of fused attention on ``[batch, heads, seq, dim]`` inputs (``QK^T`` and ``PV``)."""
    query, key, value = (t.shape for t in args[:3])
    batch_heads, seq_q, dim_qk = math.prod(query[:-2]), query[-2], query[-1]
    return 2 * batch_heads * seq_q * key[-2] * (dim_qk + value[-1])


def _ops(names: Iterable[str]) -> list[Any]:
    """The aten op packets among ``names`` that this torch build has."""
    return [getattr(aten, name) for name in names if hasattr(aten, name)]


_ACTIVATIONS = (
    "relu",
    "relu_",
    "gelu",
    "gelu_",
    "silu",
    "silu_",
    "sigmoid",
    "sigmoid_",
    "tanh",
    "tanh_",
    "elu",
    "elu_",
    "leaky_relu",
    "leaky_relu_",
    "hardtanh",
    "hardtanh_",
    "_prelu_kernel",
    "hardswish",
    "hardswish_",
    "hardsigmoid",
    "hardsigmoid_",
    "mish",
    "mish_",
    "softplus",
)
_SOFTMAX = ("_softmax", "_log_softmax", "_safe_softmax")
_ARITHMETIC = ("add", "sub", "rsub", "mul", "div", "pow", "sqrt", "rsqrt", "exp", "log", "reciprocal")
_REDUCTIONS = ("sum", "mean")
_POOLING = (
    "max_pool1d",
    "max_pool2d",
    "max_pool3d",
    "max_pool1d_with_indices",
    "max_pool2d_with_indices",
    "max_pool3d_with_indices",
    "avg_pool1d",
    "avg_pool2d",
    "avg_pool3d",
    "adaptive_avg_pool1d",
    "_adaptive_avg_pool2d",
    "_adaptive_avg_pool3d",
    "adaptive_max_pool1d",
    "adaptive_max_pool2d",
    "adaptive_max_pool3d",
)
_UPSAMPLING = (
    "upsample_nearest1d",
    "upsample_nearest2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "upsample_bicubic2d",
    "upsample_trilinear3d",
    "_upsample_bilinear2d_aa",
    "_upsample_bicubic2d_aa",
)
# Fused attention kernels PyTorch's counter has no formula for (the CPU and out-of-tree device kernels).
_ATTENTION = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable")


def _rules() -> dict[Any, Formula]:
    rules: dict[Any, Formula] = {}
    rules.update(dict.fromkeys(_ops(_ACTIVATIONS + _SOFTMAX + _POOLING), _input_elements))
    rules.update(dict.fromkeys(_ops(_ARITHMETIC), _float_output_elements))
    rules.update(dict.fromkeys(_ops(_REDUCTIONS), _float_input_elements))
    rules.update(dict.fromkeys(_ops(_UPSAMPLING), _output_elements))
    rules.update(dict.fromkeys(_ops(("native_layer_norm",)), _layer_norm))
    rules.update(dict.fromkeys(_ops(("native_group_norm",)), _group_norm))
    rules.update(dict.fromkeys(_ops(("_native_batch_norm_legit", "native_batch_norm")), _batch_norm(None)))
    rules.update(dict.fromkeys(_ops(("cudnn_batch_norm", "miopen_batch_norm")), _batch_norm(None)))
    rules.update(dict.fromkeys(_ops(("_batch_norm_with_update",)), _batch_norm(True)))
    eval_batch_norm = ("_native_batch_norm_legit_no_training", "_batch_norm_no_update")
    rules.update(dict.fromkeys(_ops(eval_batch_norm), _batch_norm(False)))
    rules.update(dict.fromkeys(_ops(("_fused_rms_norm",)), _rms_norm))
    rules.update(dict.fromkeys(_ops(("native_dropout",)), _dropout))
    rules.update(dict.fromkeys(_ops(_ATTENTION), _attention))
    return rules


#: Ops whose flops are multiply-accumulates (two flops each): PyTorch's own formulas and the fused attention above.
MATMUL_OPS: frozenset[Any] = frozenset(
    set(FlopCounterMode(display=False).flop_registry) | set(_ops(_ATTENTION))  # the counter's built-in table
)


def counter_mapping() -> dict[Any, Formula]:
    """The ``custom_mapping`` for ``FlopCounterMode``: a formula for each element-wise op.

    Each op's overloads are listed as well as the op itself: the counter splits an op it has no formula for into
    the ops it is built from when it can (nearest upsampling into index arithmetic, for one), and it looks for the
    overload to decide that; it looks for the op to count.
    """
    mapping: dict[Any, Formula] = {}
    for packet, formula in _rules().items():
        mapping[packet] = formula
        for name in packet.overloads():
            mapping[getattr(packet, name)] = formula
    return mapping


# Element-wise flops per hidden unit and step besides the gate pre-activations: RNN adds its two products; GRU its
# reset product, three additions and the update's products and sums; LSTM four additions and six products/sums.
_RECURRENT_EXTRA = {nn.RNN: 1, nn.RNNCell: 1, nn.GRU: 7, nn.GRUCell: 7, nn.LSTM: 10, nn.LSTMCell: 10}
RECURRENT_TYPES: tuple[type, ...] = tuple(_RECURRENT_EXTRA)


def _recurrent_step(module: Any, suffix: str) -> tuple[int, int]:
    """(flops, MACs) of one step of one layer of ``module`` for one sequence; ``suffix`` names the layer's weights."""
    w_ih, w_hh = getattr(module, f"weight_ih{suffix}"), getattr(module, f"weight_hh{suffix}")
    gates = int(w_ih.shape[0])
    macs = int(w_ih.numel() + w_hh.numel())
    flops = 2 * macs - 2 * gates  # a dot product of length k is k products and k - 1 sums
    flops += _RECURRENT_EXTRA[next(t for t in RECURRENT_TYPES if isinstance(module, t))] * int(module.hidden_size)
    if module.bias:
        flops += int(getattr(module, f"bias_ih{suffix}").shape[0] + getattr(module, f"bias_hh{suffix}").shape[0])
    return flops, macs


def recurrent_counts(module: Any, inputs: tuple[Any, ...]) -> tuple[int, int]:
    """(flops, MACs) of one forward of a recurrent module (``RECURRENT_TYPES``) on ``inputs``.

    Per step of each layer: the input and hidden products (``2k - 1`` flops per output of a length-``k`` dot product),
    the biases, and the gate arithmetic; times the steps of every sequence (the rows of a packed sequence), doubled
    when bidirectional. MACs are the products' multiply-accumulates.
    """
    data = inputs[0]
    data = data.data if isinstance(data, nn.utils.rnn.PackedSequence) else data
    steps = int(data.numel()) // max(int(data.shape[-1]), 1)  # batch x sequence, or rows of a packed sequence
    if isinstance(module, nn.RNNCellBase):
        flops, macs = _recurrent_step(module, "")
        return flops * steps, macs * steps
    directions = 2 if module.bidirectional else 1
    layers = [_recurrent_step(module, f"_l{layer}") for layer in range(module.num_layers)]
    return (sum(f for f, _ in layers) * steps * directions, sum(m for _, m in layers) * steps * directions)
