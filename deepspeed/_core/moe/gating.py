"""Top-1 and top-2 token routing with expert capacity, token dropping and the load-balancing loss.

Every function here works on one rank's tokens: ``logits`` is ``(S, E)`` for ``S`` tokens and ``E``
experts. The routing is computed as :class:`Routes`, ``k`` routes per token, each an expert index, a slot
in that expert's ``C``-slot buffer (``C`` being the expert capacity) and a gate weight; a route that lost
its slot has expert ``-1`` and weight 0. The public ``top1gating`` / ``top2gating`` / ``TopKGate.forward``
return upstream's dense form built from it: two ``(S, E, C)`` tensors, ``combine_weights`` (the gate value
of token ``s`` in slot ``c`` of expert ``e``, 0 elsewhere) and ``dispatch_mask`` (its non-zero pattern).
The MoE layer uses the routes directly ([Note: sparse routes] in ``layer.py``).

[Note: slot priority] Which tokens keep a slot when an expert is over capacity: with random token
selection (``use_rts``) each routed token draws a uniform priority from the global torch RNG and the
``C`` highest win, so the choice is reproducible under ``torch.manual_seed``; without it tokens are
served first come, first served in sequence order. Top-2 gating always uses sequence order, every
first choice before any second choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from deepspeed._core.comm import dist
from deepspeed._core.comm.collectives import max_over

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


@dataclass(frozen=True)
class Routes:
    """One rank's routing decision, ``k`` routes per token (``(k, S)`` tensors, route 0 the first choice).

    Attributes:
        l_aux: the load-balancing loss (a differentiable scalar).
        capacity: slots per expert, ``C``.
        num_experts: experts across the expert-parallel group, ``E``.
        experts: ``(k, S)`` int64 expert of each route, ``-1`` where the route was dropped.
        slots: ``(k, S)`` int64 slot in that expert's buffer (0 where dropped).
        weights: ``(k, S)`` gate weights in the router's dtype (differentiable; 0 where dropped).
        exp_counts: tokens each expert was chosen for before capacity (on the host).
    """

    l_aux: torch.Tensor
    capacity: int
    num_experts: int
    experts: torch.Tensor
    slots: torch.Tensor
    weights: torch.Tensor
    exp_counts: torch.Tensor

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Upstream's ``(combine_weights, dispatch_mask)``, both ``(S, E, C)``."""
        combine_weights = None
        for expert, slot, weight in zip(self.experts, self.slots, self.weights, strict=False):
            mask = F.one_hot(expert.clamp(min=0), self.num_experts).to(weight.dtype)
            mask = mask * (expert >= 0).unsqueeze(1).to(weight.dtype)
            part = _combine(weight.unsqueeze(1) * mask, slot, self.capacity)
            combine_weights = part if combine_weights is None else combine_weights + part
        assert combine_weights is not None, "a route record holds at least one route per token"
        return combine_weights, combine_weights.bool()


def _routes(
    l_aux: torch.Tensor,
    cap: int,
    choices: list[torch.Tensor],
    masks: list[torch.Tensor],
    slots: list[torch.Tensor],
    weights: list[torch.Tensor],
    exp_counts: torch.Tensor,
) -> Routes:
    """Pack per-route ``(S,)`` choices, capacity-masked ``(S, E)`` one-hots, slots and weights."""
    experts = [torch.where(mask.sum(dim=1) > 0, choice, -1) for choice, mask in zip(choices, masks, strict=False)]
    return Routes(
        l_aux, int(cap), masks[0].shape[1], torch.stack(experts), torch.stack(slots), torch.stack(weights), exp_counts
    )


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """Slots per expert: ``ceil(S / E * capacity_factor)``, at least ``min_capacity``."""
    cap = math.ceil(num_tokens / num_experts * capacity_factor)
    return max(cap, int(min_capacity))


def gumbel_rsample(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Standard Gumbel noise (``-log(-log U)``) from the global RNG."""
    uniform = torch.rand(shape, device=device).clamp_(1e-20, 1.0 - 1e-7)
    return -torch.log(-torch.log(uniform))


def multiplicative_jitter(x: torch.Tensor, epsilon: float = 1e-2) -> torch.Tensor:
    """``x`` times noise drawn uniformly from ``[1 - epsilon, 1 + epsilon]`` (the ``Jitter`` policy)."""
    if epsilon == 0:
        return x
    noise = torch.empty_like(x).uniform_(1.0 - epsilon, 1.0 + epsilon)
    return x * noise


def _agreed_capacity(needed: int, ep_group: Any) -> int:
    """Without dropping, every rank of the expert-parallel group must use the same (largest) capacity."""
    value = torch.tensor([needed], dtype=torch.int64)
    if ep_group is not None and dist.is_initialized() and dist.get_world_size(group=ep_group) > 1:
        max_over(value, ep_group)
    return int(value.item())


def _keep_by_priority(mask: torch.Tensor, cap: int) -> torch.Tensor:
    """Random token selection: keep, per expert, the ``cap`` routed tokens with the highest random priority."""
    priority = mask * torch.rand(mask.shape, device=mask.device)
    k = min(cap, mask.shape[0])
    top = torch.topk(priority, k=k, dim=0).indices
    keep = torch.zeros_like(mask).scatter_(0, top, 1)
    return mask * keep


def _slots(mask: torch.Tensor, offset: torch.Tensor | int = 0) -> torch.Tensor:
    """Position of each routed token in its expert's queue (sequence order), per ``(S, E)`` entry."""
    return torch.cumsum(mask, dim=0) - 1 + offset


def _combine(gates_se: torch.Tensor, slot_s: torch.Tensor, cap: int) -> torch.Tensor:
    """``(S, E, C)`` combine weights from per-token gate values and slot indices."""
    slot_sc = F.one_hot(slot_s, num_classes=cap).to(gates_se.dtype)
    return torch.einsum("se,sc->sec", gates_se, slot_sc)


def top1gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group: Any = None,
    use_tutel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route each token to its highest-scoring expert.

    Returns ``(l_aux, combine_weights, dispatch_mask, exp_counts)``; ``exp_counts`` counts the tokens
    each expert was chosen for before capacity was applied (on the host).
    """
    if use_tutel:
        raise ValueError("top1gating(use_tutel=True): tutel is not supported; use use_tutel=False")
    routes = _route_top1(
        logits, capacity_factor, min_capacity, used_token, noisy_gate_policy, drop_tokens, use_rts, ep_group
    )
    return (routes.l_aux, *routes.dense(), routes.exp_counts)


def top2gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: Any = None,
    top2_2nd_expert_sampling: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route each token to its two best experts, gate values renormalised over the pair.

    The second expert is picked after Gumbel noise when ``top2_2nd_expert_sampling``. Capacity is
    computed for twice the tokens. Returns ``(l_aux, combine_weights, dispatch_mask, exp_counts)``.
    """
    routes = _route_top2(logits, capacity_factor, min_capacity, drop_tokens, ep_group, top2_2nd_expert_sampling)
    return (routes.l_aux, *routes.dense(), routes.exp_counts)


def _route_top1(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None,
    noisy_gate_policy: str | None,
    drop_tokens: bool,
    use_rts: bool,
    ep_group: Any,
) -> Routes:
    """Top-1 routing as :class:`Routes` (the arguments of :func:`top1gating`)."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    cap = capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    scores = gates
    if noisy_gate_policy == "RSample":
        scores = logits + gumbel_rsample(tuple(logits.shape), logits.device)
    choice = torch.argmax(scores, dim=1)
    mask = F.one_hot(choice, num_classes=num_experts).to(gates.dtype)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach().to("cpu")
    if not drop_tokens:
        cap = _agreed_capacity(int(exp_counts.max().item()), ep_group)
    # Load-balancing loss: E * sum_e (mean gate of e) * (fraction of tokens routed to e).
    l_aux = torch.sum(gates.mean(dim=0) * mask.mean(dim=0)) * num_experts
    if use_rts:
        mask = _keep_by_priority(mask, cap)
        slot = _slots(mask)
    else:
        slot = _slots(mask)
        mask = mask * (slot < cap).to(mask.dtype)
    slot_s = (slot * mask).sum(dim=1).long()
    return _routes(l_aux, cap, [choice], [mask], [slot_s], [(gates * mask).sum(dim=1)], exp_counts)


def _route_top2(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool,
    ep_group: Any,
    top2_2nd_expert_sampling: bool,
) -> Routes:
    """Top-2 routing as :class:`Routes` (the arguments of :func:`top2gating`)."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    choice1 = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(choice1, num_classes=num_experts).to(gates.dtype)
    second = logits
    if top2_2nd_expert_sampling:
        second = logits + gumbel_rsample(tuple(logits.shape), logits.device)
    second = second.masked_fill(mask1.bool(), float("-inf"))
    choice2 = torch.argmax(second, dim=1)
    mask2 = F.one_hot(choice2, num_classes=num_experts).to(gates.dtype)
    slot1 = _slots(mask1)
    slot2 = _slots(mask2, mask1.sum(dim=0, keepdim=True))  # second choices queue behind all first ones
    exp_counts = (mask1 + mask2).sum(dim=0).detach().to("cpu")
    l_aux = torch.sum(gates.mean(dim=0) * mask1.mean(dim=0)) * num_experts
    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (slot1 < cap).to(mask1.dtype)
        mask2 = mask2 * (slot2 < cap).to(mask2.dtype)
    else:
        needed = int(max((slot1 * mask1).max().item(), (slot2 * mask2).max().item())) + 1
        cap = _agreed_capacity(needed, ep_group)
    slot1_s = (slot1 * mask1).sum(dim=1).long()
    slot2_s = (slot2 * mask2).sum(dim=1).long()
    g1 = (gates * mask1).sum(dim=1)
    g2 = (gates * mask2).sum(dim=1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(gates.dtype).eps)
    return _routes(
        l_aux, cap, [choice1, choice2], [mask1, mask2], [slot1_s, slot2_s], [g1 / denom, g2 / denom], exp_counts
    )


class TopKGate(torch.nn.Module):
    """The learned router: a bias-free fp32 linear map from tokens to expert scores, then top-k gating.

    Args:
        model_dim: token width.
        num_experts: experts across all expert-parallel ranks.
        k: 1 or 2.
        capacity_factor: capacity multiplier in training; ``eval_capacity_factor`` in eval mode.
        min_capacity: lower bound on slots per expert.
        noisy_gate_policy: ``None``, ``"Jitter"`` (multiplicative input noise) or ``"RSample"`` (Gumbel
            noise on the top-1 choice), applied in training only.
        drop_tokens: drop tokens over capacity; otherwise capacity grows to fit every token.
        use_rts: random token selection ([Note: slot priority]).
        ep_group: expert-parallel group (agrees on capacity when tokens are not dropped).
        top2_2nd_expert_sampling: sample the second expert with Gumbel noise (top-2).
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group: Any = None,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if k not in (1, 2):
            raise ValueError(f"TopKGate(k={k}): only top-1 and top-2 gating are supported (k=1 or k=2)")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"noisy_gate_policy={noisy_gate_policy!r} is not valid; valid: {NOISY_GATE_POLICIES}")
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False).float()
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown = False
        self.gate_time = 0.0

    def _set_ep_group(self, ep_group: Any) -> None:
        """Install the expert-parallel group once the groups exist."""
        self.ep_group = ep_group

    def forward(
        self, input: torch.Tensor, used_token: torch.Tensor | None = None, use_tutel: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gate ``(S, model_dim)`` tokens; returns ``(l_aux, combine_weights, dispatch_mask, exp_counts)``."""
        if use_tutel:
            raise ValueError("TopKGate(use_tutel=True): tutel is not supported; use use_tutel=False")
        routes = self.route(input, used_token)
        return (routes.l_aux, *routes.dense(), routes.exp_counts)

    def route(self, input: torch.Tensor, used_token: torch.Tensor | None = None) -> Routes:
        """Gate ``(S, model_dim)`` tokens into :class:`Routes` (what the MoE layer dispatches by)."""
        # The router runs in fp32 whatever the model's dtype: its softmax decides discrete routes.
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            policy = self.noisy_gate_policy if self.training else None
            return _route_top1(
                logits, factor, self.min_capacity, used_token, policy, self.drop_tokens, self.use_rts, self.ep_group
            )
        return _route_top2(
            logits, factor, self.min_capacity, self.drop_tokens, self.ep_group, self.top2_2nd_expert_sampling
        )
