"""Mixture-of-experts layer: gate, dispatch over the expert-parallel group, local experts, combine.

Data flow for one forward, ``E`` experts over ``P`` expert-parallel ranks, ``L = E / P`` local ones:
tokens ``(S, M)`` are gated into ``(E, C, M)`` expert slots; an all-to-all over the expert-parallel
group sends slots ``[jL, (j+1)L)`` to rank ``j`` and gathers, from every rank, the slots of this rank's
experts, ``(P, L, C, M)``; each local expert runs on its ``(P, C, M)`` slice; a second all-to-all returns
the outputs, which the combine weights fold back into ``(S, M)``. With ``P == 1`` both exchanges are the
identity and are skipped.

[Note: sparse routes] Dispatch and combine work from the gate's per-route indices (:class:`Routes`),
never from upstream's dense ``(S, E, C)`` combine weights and dispatch mask: those are ``S * E * C``
elements per layer (``E * C`` is about ``k * S * capacity_factor``, so quadratic in the tokens), and autograd
would keep them until backward -- hundreds of MiB per layer at a few thousand tokens. Dispatch is one
gather of each slot's source token (empty slots zeroed), keeping only the ``E * C`` source indices;
combine gathers each token's ``k`` expert rows and takes their gate-weighted sum as a batched ``1 x k``
by ``k x M`` product in the model dtype, keeping the ``(S, k, M)`` gathered rows and the ``(S, k)``
weights. The arithmetic is the dense einsums' with the zero terms left out: dispatch copies tokens
exactly, and combine casts the gate weights to the model dtype and accumulates the ``k`` products as a
matrix product does, so outputs and gradients match the dense formulation.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from deepspeed._core.comm.collectives import exchange
from deepspeed._core.moe.gating import NOISY_GATE_POLICIES, Routes, TopKGate


def expert_group_name(ep_size: int) -> str:
    """Name of the expert-parallel group of size ``ep_size`` (also stored on every expert parameter)."""
    return f"ep_size_{ep_size}"


def mark_expert_params(module: torch.nn.Module, group_name: str | None) -> None:
    """Tag ``module``'s parameters as expert parameters of ``group_name`` (upstream's attribute names)."""
    for param in module.parameters():
        tagged: Any = param  # the tags are plain attributes on the Parameter, upstream's interface
        tagged.allreduce = False  # reduced over the expert-data-parallel group, not the data-parallel one
        tagged.group_name = group_name


def dispatch(tokens: torch.Tensor, routes: Routes) -> torch.Tensor:
    """``(S, M)`` tokens into ``(E, C, M)`` expert slots by ``routes``; empty slots are zero ([Note: sparse routes])."""
    num_tokens, d_model = tokens.shape
    num_slots = routes.num_experts * routes.capacity
    # Source token of every slot; dropped routes write to one extra scratch entry, cut off below.
    flat = torch.where(routes.experts >= 0, routes.experts * routes.capacity + routes.slots, num_slots)
    source = torch.full((num_slots + 1,), num_tokens, dtype=torch.long, device=tokens.device)
    token_ids = torch.arange(num_tokens, device=tokens.device).expand_as(flat)
    source = source.scatter_(0, flat.reshape(-1), token_ids.reshape(-1))[:num_slots]
    empty = (source == num_tokens).unsqueeze(1)
    slots = tokens.index_select(0, source.clamp(max=max(num_tokens - 1, 0)))
    return slots.masked_fill_(empty, 0).view(routes.num_experts, routes.capacity, d_model)


def combine(expert_out: torch.Tensor, routes: Routes, dtype: torch.dtype) -> torch.Tensor:
    """``(E, C, M)`` expert outputs back to ``(S, M)`` tokens, gate-weighted ([Note: sparse routes])."""
    d_model = expert_out.shape[-1]
    k, num_tokens = routes.experts.shape
    # A dropped route reads slot 0 with weight 0, so it adds nothing (as its all-zero dense row did).
    flat = torch.where(routes.experts >= 0, routes.experts * routes.capacity + routes.slots, 0)
    routed = expert_out.reshape(-1, d_model).index_select(0, flat.t().reshape(-1)).view(num_tokens, k, d_model)
    weights = routes.weights.t().to(dtype).unsqueeze(1)
    return torch.bmm(weights, routed).squeeze(1)


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0 whose backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx: Any, group: Any, input: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        input = input.contiguous()
        output = torch.empty_like(input)
        exchange(output, input, group)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, _AllToAll.apply(ctx.group, grad_output)


class Experts(torch.nn.Module):
    """``num_local_experts`` independent copies of ``expert``, each applied to its own slice of slots.

    Args:
        expert: the expert module (deep-copied; the original is not registered).
        num_local_experts: experts held on this rank.
        expert_group_name: expert-parallel group name recorded on each parameter.
    """

    def __init__(self, expert: torch.nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None):
        super().__init__()
        self.deepspeed_experts = torch.nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        mark_expert_params(self, expert_group_name)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs`` is ``(P, L, C, M)``; expert ``i`` sees ``inputs[:, i]``."""
        outputs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts, strict=True):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs, dim=1)


class MOELayer(torch.nn.Module):
    """Gate + dispatch/combine + local experts (the ``deepspeed_moe`` child of :class:`MoE`).

    Args:
        gate: the router.
        experts: this rank's experts.
        ep_group_name: expert-parallel group name.
        ep_size: expert-parallel world size.
        num_local_experts: experts on this rank.
        use_tutel: must be ``False`` (tutel kernels are not available).
    """

    def __init__(
        self,
        gate: TopKGate,
        experts: Experts,
        ep_group_name: str,
        ep_size: int,
        num_local_experts: int,
        use_tutel: bool = False,
    ) -> None:
        super().__init__()
        if use_tutel:
            raise ValueError("MoE(use_tutel=True) is not supported: tutel is not available; use use_tutel=False")
        self.gate = gate
        self.experts = experts
        self.ep_group = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.use_tutel = False
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None
        self.wall_clock_breakdown = False
        self.time_falltoall = self.time_salltoall = self.time_moe = 0.0

    def _set_ep_group(self, ep_group: Any) -> None:
        """Install the expert-parallel group (gate included)."""
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def _exchange(self, slots: torch.Tensor) -> torch.Tensor:
        if self.ep_size == 1:
            return slots
        if self.ep_group is None:
            raise RuntimeError(
                f"MoE layer with ep_size={self.ep_size} has no expert-parallel group: call "
                "set_deepspeed_parallelism() (deepspeed.initialize does) before the first forward"
            )
        return _AllToAll.apply(self.ep_group, slots)

    def forward(self, *input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Route ``input[0]`` (any shape ending in the model width); ``input[1]`` is an optional token mask."""
        hidden = input[0]
        d_model = hidden.shape[-1]
        tokens = hidden.reshape(-1, d_model)
        used_token = input[1] if len(input) > 1 else None
        routes = self.gate.route(tokens, used_token)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        slots = self._exchange(dispatch(tokens, routes))
        # (E, C, M) from P ranks -> (P, L, C, M): block j of the exchange holds rank j's tokens.
        expert_in = slots.reshape(self.ep_size, self.num_local_experts, -1, d_model)
        expert_out = self.experts(expert_in)
        expert_out = self._exchange(expert_out.reshape(self.ep_size * self.num_local_experts, -1, d_model))
        return combine(expert_out, routes, tokens.dtype).reshape(hidden.shape)


class MoECore(torch.nn.Module):
    """The MoE layer behind ``deepspeed.moe.layer.MoE`` (see that class for the arguments)."""

    def __init__(
        self,
        hidden_size: int,
        expert: torch.nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        _check_arguments(num_experts, ep_size, k, noisy_gate_policy, use_tutel, enable_expert_tensor_parallelism)
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = expert_group_name(ep_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        sizes = (hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity)
        gate = TopKGate(*sizes, noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = torch.nn.Linear(hidden_size, 2)

    def set_ep_group(self, ep_group: Any) -> None:
        """Install the expert-parallel process group used by the token exchange."""
        self.deepspeed_moe._set_ep_group(ep_group)

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns ``(output, l_aux, exp_counts)``; ``output`` has the shape of ``hidden_states``."""
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        l_aux, exp_counts = self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
        assert l_aux is not None and exp_counts is not None, "the gate sets both on every forward"
        return output, l_aux, exp_counts


def _check_arguments(
    num_experts: int,
    ep_size: int,
    k: int,
    noisy_gate_policy: str | None,
    use_tutel: bool,
    enable_expert_tensor_parallelism: bool,
) -> None:
    if ep_size < 1 or num_experts < 1 or num_experts % ep_size != 0:
        raise ValueError(
            f"MoE(num_experts={num_experts}, ep_size={ep_size}): num_experts must be a positive multiple of "
            "ep_size (each expert-parallel rank holds num_experts / ep_size experts)"
        )
    if k not in (1, 2):
        raise ValueError(f"MoE(k={k}): only top-1 and top-2 gating are supported (k=1 or k=2)")
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(f"MoE(noisy_gate_policy={noisy_gate_policy!r}) is not valid; valid: {NOISY_GATE_POLICIES}")
    if use_tutel:
        raise ValueError("MoE(use_tutel=True) is not supported: tutel is not available; use use_tutel=False")
    if enable_expert_tensor_parallelism:
        raise NotImplementedError(
            "MoE(enable_expert_tensor_parallelism=True) is not supported: expert tensor parallelism needs a "
            "model-parallel unit, which deepspeed-lean's MoE does not implement; use the default False"
        )
