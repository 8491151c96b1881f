"""Stage 0: plain data parallelism with optional fp16/bf16 master weights.

Every rank keeps whole parameters and gradients. Gradients accumulate in ``.grad`` across micro-steps
and are all-reduced (bucketed, overlapped with the boundary backward) before the step. With fp16 or
bf16 working weights the inner optimizer steps on fp32 masters (:class:`MasterWeights`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from deepspeed._core.comm import dist
from deepspeed._core.comm.collectives import max_over
from deepspeed._core.config.plan import RunPlan
from deepspeed._core.engine.precision import MasterWeights, has_inf_or_nan
from deepspeed._core.grads.replicas import ReplicaGrads
from deepspeed._core.grads.scaling import ReduceScaling
from deepspeed._core.moe.params import ExpertGroup, by_reduce_group
from deepspeed._core.optim.base import EngineOptimizer, MicroStepKind
from deepspeed._core.optim.clipping import NormScope, clip_, counts_in_norm, global_norm, global_norm_of_parts
from deepspeed._core.optim.hp_mapping import attach_hp_mapping, detach_hp_mapping


class DataParallelOptimizer(EngineOptimizer):
    """Wraps a torch optimizer for stage 0.

    Args:
        optimizer: the inner optimizer, built over the model's (working) parameters.
        plan: the run plan (precision, gradient policy, bucket sizes).
        loss_scaler: a loss scaler for fp16, else ``None``.
        dp_group: data-parallel group; ``None`` = world.
        dp_world_size: size of ``dp_group``.
        expert_groups: process groups of each expert group, by name, when the model has MoE layers: expert
            gradients are all-reduced over their expert-data-parallel group instead of ``dp_group``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        plan: RunPlan,
        loss_scaler: Any,
        dp_group: Any,
        dp_world_size: int,
        expert_groups: Mapping[str, ExpertGroup] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.plan = plan
        self.loss_scaler = loss_scaler
        precision = plan.precision
        needs_master = precision.param_dtype != precision.master_dtype
        self.masters = MasterWeights(optimizer, precision.master_dtype) if needs_master else None
        self.params = self._working_params()
        self.dp_group = dp_group
        self.expert_groups = dict(expert_groups or {})
        # One all-reduce per reduction group: shared parameters over dp_group, each expert group over its
        # expert-data-parallel group. Both divide by the full dp_world_size: every rank's loss feeds the
        # experts through the token exchange, so that is the mean the single-process model would compute.
        self.parts = by_reduce_group([p for p in self.params if p.requires_grad])
        self.syncs: list[ReplicaGrads] = []
        if dp_world_size > 1:
            scaling = ReduceScaling.from_policy(plan.grads, dp_world_size)
            for name, params in self.parts:
                if params:
                    group = dp_group if name is None else self.expert_groups[name].edp_group
                    self.syncs.append(
                        ReplicaGrads(params, plan.zero.buckets.reduce_bucket_size, precision.comm_dtype, scaling, group)
                    )
        self.check_overflow = precision.fp16 or (precision.bf16 and precision.check_grad_overflow)
        attach_hp_mapping(self)  # safe_get_full_fp32_param & co.

    def _working_params(self) -> list[torch.nn.Parameter]:
        if self.masters is not None:
            return self.masters.working_params()
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def prepare_backward(self, kind: MicroStepKind) -> None:
        """Arm the overlapped all-reduce when this backward ends the accumulation window."""
        if kind is MicroStepKind.REDUCE:
            for sync in self.syncs:
                sync.arm()

    def finish_backward(self) -> None:
        """Complete the all-reduce of this window's gradients (no-op between boundaries)."""
        for sync in self.syncs:
            sync.finish()

    def step(self, closure: Any = None) -> bool:
        """Check overflow, unscale, clip, step the inner optimizer and refresh working weights."""
        grads = [p.grad for p in self.params if p.grad is not None]
        self.overflow = self.check_overflow and self._any_overflow(grads)
        if self.overflow:
            self._global_grad_norm = None
            self.zero_grad()
            if self.loss_scaler is not None:
                self.loss_scaler.update_scale(True)
            return False
        scale = self.cur_scale
        if self.masters is not None:
            self.masters.grads_to_masters(scale)
            owned = [(p, m.grad) for p, m in self.masters.pairs if m.grad is not None]
        else:
            owned = [(p, p.grad) for p in self.params if p.grad is not None]
            if scale != 1.0:
                torch._foreach_mul_(grads, 1.0 / scale)
        grads = [g for _, g in owned]
        self._global_grad_norm = self._norm(owned)
        clip_(grads, self._global_grad_norm, self.plan.grads.clip_norm)
        self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        if self.masters is not None:
            self.masters.masters_to_working()
            self.masters.drop_master_grads()
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(False)
        return True

    def _any_overflow(self, grads: list[torch.Tensor]) -> bool:
        local = has_inf_or_nan(grads)
        groups = []
        if self.expert_groups and dist.is_initialized():
            groups.append(self.dp_group)  # expert gradients differ between expert-parallel ranks
        if self.stage_group is not None:
            groups.append(self.stage_group)  # pipeline: skip on every stage together
        if not groups:
            # After the all-reduce every rank holds the same sums, so an inf on any rank is seen by all
            # and they all skip together without an extra collective.
            return local
        flag = torch.tensor([1.0 if local else 0.0], device=self.params[0].device)
        for group in groups:
            max_over(flag, group)
        return bool(flag.item() > 0)

    def _norm(self, owned: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> float:
        """Global norm of the (unscaled) gradients of ``(param, grad)`` pairs: each expert and each pipeline-tied
        weight counted once, every pipeline stage included."""
        counted = [(p, g) for p, g in owned if counts_in_norm(p)]
        if not self.expert_groups:
            return global_norm([g for _, g in counted], NormScope.REPLICATED, stage_group=self.stage_group)
        grad_of = {id(p): g for p, g in counted}
        parts = []
        for name, params in self.parts:
            group = None if name is None else self.expert_groups[name].ep_group
            parts.append(([grad_of[id(p)] for p in params if id(p) in grad_of], group))
        return global_norm_of_parts(parts, stage_group=self.stage_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the working gradients (and masters' gradients, if any)."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        if self.masters is not None:
            self.masters.drop_master_grads()

    def refresh_fp32_params(self) -> None:
        """Rebuild the fp32 masters from the current working weights (after a module-only load)."""
        if self.masters is not None:
            with torch.no_grad():
                for param, master in self.masters.pairs:
                    master.copy_(param)

    def destroy(self) -> None:
        """Remove the all-reduce hooks."""
        for sync in self.syncs:
            sync.remove_hooks()
        self.syncs = []
        detach_hp_mapping(self)

    def state_dict(self) -> dict:
        """Inner optimizer state plus loss-scaler state and fp32 masters (when present)."""
        sd: dict = {"optimizer_state_dict": self.optimizer.state_dict()}
        if self.loss_scaler is not None:
            sd["loss_scaler"] = self.loss_scaler
            sd["dynamic_loss_scale"] = bool(getattr(self.loss_scaler, "dynamic", False))
        if self.masters is not None:
            sd["fp32_groups"] = [m.detach().clone() for _, m in self.masters.pairs]
        sd["overflow"] = self.overflow
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict` output (masters refreshed from the saved fp32 copies)."""
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        if "loss_scaler" in state_dict and self.loss_scaler is not None:
            self.loss_scaler = state_dict["loss_scaler"]
        if self.masters is not None and "fp32_groups" in state_dict:
            with torch.no_grad():
                for (_, master), saved in zip(self.masters.pairs, state_dict["fp32_groups"], strict=False):
                    master.copy_(saved)
            self.masters.masters_to_working()
        self.overflow = bool(state_dict.get("overflow", False))
