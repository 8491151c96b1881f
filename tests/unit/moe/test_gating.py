"""Gating on one rank: capacity, token dropping, the load-balancing loss by hand, top-2 ordering, RTS."""

from __future__ import annotations

import math

import pytest
import torch

from deepspeed.moe.sharded_moe import TopKGate, _capacity, top1gating, top2gating


def _logits_for(choices: list[int], num_experts: int, second: list[int] | None = None) -> torch.Tensor:
    """Logits whose argmax is ``choices[s]`` (and runner-up ``second[s]``) with distinct gate values."""
    logits = torch.zeros(len(choices), num_experts)
    for s, e in enumerate(choices):
        logits[s, e] = 2.0 + 0.1 * s
        if second is not None:
            logits[s, second[s]] = 1.0 + 0.05 * s
    return logits


def test_capacity_formula() -> None:
    gates = torch.zeros(10, 4)
    assert _capacity(gates, 1.0, 1) == 3  # ceil(10 / 4)
    assert _capacity(gates, 2.0, 1) == 5
    assert _capacity(gates, 1.0, 6) == 6  # min_capacity wins


def test_top1_drops_over_capacity_in_sequence_order() -> None:
    choices = [0, 0, 0, 1, 0, 2]  # expert 0 chosen 4 times, capacity ceil(6/4)=2
    l_aux, combine, dispatch, counts = top1gating(_logits_for(choices, 4), 1.0, 1, use_rts=False)
    assert combine.shape == (6, 4, 2)
    assert counts.tolist() == [4, 1, 1, 0]  # counted before capacity
    served = dispatch.any(dim=2).any(dim=1).tolist()
    assert served == [True, True, False, True, False, True]  # third and fourth choosers of expert 0 dropped
    # Slots are handed out in order and each served token's weight is its softmax gate.
    gates = torch.softmax(_logits_for(choices, 4), dim=1)
    assert dispatch[0, 0, 0] and dispatch[1, 0, 1] and dispatch[3, 1, 0] and dispatch[5, 2, 0]
    torch.testing.assert_close(combine[1, 0, 1], gates[1, 0])
    assert combine[2].abs().sum() == 0 and combine[4].abs().sum() == 0


def test_top1_l_aux_by_hand() -> None:
    logits = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 3.0]])
    l_aux, *_ = top1gating(logits, 1.0, 1, use_rts=False)
    gates = torch.softmax(logits, dim=1)
    frac = [2 / 4, 1 / 4, 1 / 4]  # argmax: 0, 1, 0, 2
    expected = 3 * sum(float(gates[:, e].mean()) * frac[e] for e in range(3))
    assert math.isclose(float(l_aux), expected, rel_tol=1e-6)


def test_top1_no_drop_grows_capacity() -> None:
    choices = [1] * 7 + [0]
    _, combine, dispatch, _ = top1gating(_logits_for(choices, 4), 1.0, 1, drop_tokens=False, use_rts=False)
    assert combine.shape[2] == 7  # capacity = most tokens sent to one expert
    assert dispatch.any(dim=2).any(dim=1).all()


def test_top2_ordering_and_renormalised_gates() -> None:
    first = [0, 0, 1, 0]
    second = [1, 2, 0, 1]
    logits = _logits_for(first, 3, second)
    _, combine, dispatch, counts = top2gating(logits, 1.0, 1, top2_2nd_expert_sampling=False)
    cap = math.ceil(4 / 3 * 2)  # 3
    assert combine.shape == (4, 3, cap)
    assert counts.tolist() == [4, 3, 1]
    # Expert 0: first choices of tokens 0, 1, 3 take slots 0..2; token 2's second choice (expert 0) would
    # queue behind them at slot 3 and is dropped.
    assert dispatch[0, 0, 0] and dispatch[1, 0, 1] and dispatch[3, 0, 2] and not dispatch[2, 0].any()
    # Expert 1: token 2's first choice gets slot 0, then second choices of tokens 0 and 3.
    assert dispatch[2, 1, 0] and dispatch[0, 1, 1] and dispatch[3, 1, 2]
    gates = torch.softmax(logits, dim=1)
    g0, g1 = gates[0, 0], gates[0, 1]
    torch.testing.assert_close(combine[0, 0, 0], g0 / (g0 + g1))
    torch.testing.assert_close(combine[0, 1, 1], g1 / (g0 + g1))
    # Token 2 lost its second expert: its first gate is renormalised to 1.
    torch.testing.assert_close(combine[2].sum(), torch.tensor(1.0))


def test_top2_l_aux_uses_first_choices() -> None:
    logits = torch.randn(16, 4, generator=torch.Generator().manual_seed(3))
    l_aux, *_ = top2gating(logits, 1.0, 1, top2_2nd_expert_sampling=False)
    gates = torch.softmax(logits, dim=1)
    first = gates.argmax(dim=1)
    expected = 4 * sum(float(gates[:, e].mean()) * float((first == e).float().mean()) for e in range(4))
    assert math.isclose(float(l_aux), expected, rel_tol=1e-6)


def test_random_token_selection_is_seeded() -> None:
    logits = _logits_for([0] * 12, 4)  # all 12 tokens want expert 0, capacity 3

    def kept(seed: int) -> list[int]:
        torch.manual_seed(seed)
        _, _, dispatch, _ = top1gating(logits, 1.0, 1, use_rts=True)
        return [s for s in range(12) if dispatch[s].any()]

    assert kept(0) == kept(0) and len(kept(0)) == 3
    assert any(kept(0) != kept(seed) for seed in range(1, 6))  # the choice really is random


def test_gate_eval_capacity_and_fp32_router() -> None:
    gate = TopKGate(8, 4, k=1, capacity_factor=1.0, eval_capacity_factor=2.0, min_capacity=1).to(torch.bfloat16)
    x = torch.randn(8, 8, dtype=torch.bfloat16)
    _, train_combine, _, _ = gate(x)
    gate.eval()
    _, eval_combine, _, _ = gate(x)
    assert train_combine.shape[2] == 2 and eval_combine.shape[2] == 4
    assert train_combine.dtype == torch.float32  # routing is computed in fp32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"k": 3}, "k=3"),
        ({"noisy_gate_policy": "Gaussian"}, "noisy_gate_policy"),
    ],
)
def test_gate_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TopKGate(8, 4, **kwargs)
