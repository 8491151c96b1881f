"""What autograd keeps per MoE layer for backward, byte for byte ([Note: sparse routes] in
``deepspeed/_core/moe/layer.py``).

The layer must keep only per-route indices, weights and gathered rows, never an ``(S, E, C)`` tensor: a dense
combine or dispatch tensor saved again would add ``S * E * C`` elements, far above the whole analytic figure
at these sizes. ``benchmarks/moe_saved_bytes.py`` prints the same accounting at the benchmark's shape.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepspeed.moe.layer import MoE

TOKENS, HIDDEN, EXPERTS, CAPACITY_FACTOR = 512, 16, 8, 1.25


def _saved_bytes(layer: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves during one forward, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, l_aux, _ = layer(x)
    (out.float().sum() + l_aux).backward()  # the graph built under the hooks is complete
    return sum(saved.values())


def _analytic_bytes(k: int, dtype: torch.dtype) -> int:
    """The figure term by term, for a one-``Linear`` expert (``S`` tokens, ``M`` wide, ``E`` experts, ``C`` slots)."""
    s, m, e = TOKENS, HIDDEN, EXPERTS
    c = math.ceil(s / e * CAPACITY_FACTOR * k)
    b = torch.finfo(dtype).bits // 8
    router = s * m * 4 + (m * e * 4 if dtype != torch.float32 else 0)  # fp32 router input (+ fp32 router weight)
    if k == 1:
        # softmax output, the capacity-masked one-hot (gate weight), the (E,) routed fraction in l_aux
        gating = 2 * s * e * 4 + e * 4
    else:
        # softmax output, both capacity-masked one-hots, the first-choice mask of the second pick (bool),
        # the (E,) mean in l_aux, and the renormalisation's g1, g2, g1 + g2 and its clamp
        gating = 3 * s * e * 4 + s * e + e * 4 + 4 * s * 4
    dispatch = e * c * 8 + e * c + e * c * m * b  # source index, empty-slot mask, the slots (expert input)
    combine = k * s * 8 + s * k * b + s * k * m * b  # route index, weights in the model dtype, gathered rows
    return router + gating + dispatch + combine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2])
def test_saved_bytes_per_layer_match_the_sparse_routes_figure(k: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    layer = MoE(
        HIDDEN,
        torch.nn.Linear(HIDDEN, HIDDEN),
        num_experts=EXPERTS,
        k=k,
        capacity_factor=CAPACITY_FACTOR,
        min_capacity=4,
    ).to(dtype)
    x = torch.randn(TOKENS, HIDDEN, dtype=dtype, requires_grad=True)
    measured = _saved_bytes(layer, x)
    assert measured == _analytic_bytes(k, dtype)
    # What the figure rules out: one dense (S, E, C) tensor, even boolean, is more than all of it.
    dense_bool = TOKENS * EXPERTS * math.ceil(TOKENS / EXPERTS * CAPACITY_FACTOR * k)
    assert measured < dense_bool
