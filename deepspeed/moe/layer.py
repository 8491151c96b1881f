"""The public MoE layer (``deepspeed.moe.layer.MoE``)."""

from __future__ import annotations

from typing import Any

import torch

from deepspeed._core.moe.layer import MoECore
from deepspeed.utils import groups
from deepspeed.utils.logging import log_dist

__all__ = ["MoE"]


class MoE(MoECore):
    """Mixture-of-experts layer with expert parallelism.

    Args:
        hidden_size: token width.
        expert: the expert module, copied ``num_experts / ep_size`` times on every rank.
        num_experts: experts in total across the expert-parallel group.
        ep_size: expert-parallel size; must divide ``num_experts`` and the world size.
        k: top-k gating, 1 or 2.
        capacity_factor: expert capacity multiplier in training.
        eval_capacity_factor: expert capacity multiplier in eval mode.
        min_capacity: at least this many slots per expert.
        use_residual: residual MoE: mix the MoE output with a dense ``expert`` through a learned coefficient.
        noisy_gate_policy: ``None``, ``"Jitter"`` or ``"RSample"``.
        drop_tokens: drop tokens over capacity (otherwise capacity grows to fit them all).
        use_rts: random token selection when an expert is over capacity.
        use_tutel: must be ``False`` (no tutel kernels).
        enable_expert_tensor_parallelism: must be ``False`` (not supported).
        top2_2nd_expert_sampling: sample the second expert with Gumbel noise (top-2).

    ``forward(hidden_states, used_token=None)`` returns ``(output, l_aux, exp_counts)``.
    """

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
        super().__init__(
            hidden_size,
            expert,
            num_experts,
            ep_size,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            use_residual,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            use_tutel,
            enable_expert_tensor_parallelism,
            top2_2nd_expert_sampling,
        )
        log_dist(
            f"Creating MoE layer with num_experts: {num_experts} | num_local_experts: "
            f"{self.num_local_experts} | expert_parallel_size: {ep_size}",
            ranks=[0],
        )

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Create (once per size, collectively) the expert groups and install this layer's group."""
        self._create_process_groups(use_data_before_expert_parallel_=use_data_before_expert_parallel_)

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(self.ep_size, use_data_before_expert_parallel_)
        self.set_ep_group(groups._get_expert_parallel_group(self.expert_group_name))

    def forward(self, hidden_states: torch.Tensor, used_token: Any = None) -> tuple[Any, Any, Any]:
        """Returns ``(output, l_aux, exp_counts)``."""
        return super().forward(hidden_states, used_token)
