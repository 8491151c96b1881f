"""Which parameters are expert parameters, and optimizer parameter groups that keep them apart.

Expert parameters carry ``allreduce = False`` and ``group_name`` (set by ``Experts``). Their gradients
are reduced over the expert-data-parallel group of ``group_name`` (the ranks holding the same experts);
every other parameter is reduced over the data-parallel group. ZeRO-1/2 partitions each optimizer
parameter group over one process group, so expert parameters need groups of their own, marked
``moe: True`` and named after the expert group.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed._core.moe.layer import MoECore

DEFAULT_MAX_GROUP_SIZE = 178956971  # elements per MoE parameter group before it is split (upstream default)


def is_moe_param(param: torch.Tensor) -> bool:
    """True for an expert parameter (one tagged ``allreduce = False``)."""
    return hasattr(param, "allreduce") and not param.allreduce


def expert_group_of(param: torch.Tensor) -> str | None:
    """The expert group name of an expert parameter, ``None`` for a shared one."""
    return getattr(param, "group_name", None) if is_moe_param(param) else None


def split_params_into_shared_and_expert_params(
    params: Iterable[torch.nn.Parameter],
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """``(shared, expert)`` parameters, in input order."""
    shared: list[torch.nn.Parameter] = []
    expert: list[torch.nn.Parameter] = []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(
    group: Iterable[torch.nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(shared_grads, expert_grads)`` of the parameters that have a gradient."""
    shared: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def is_moe_param_group(param_group: dict) -> bool:
    """True for an optimizer parameter group marked ``moe``."""
    return bool(param_group.get("moe", False))


def _as_group_list(param_groups: Any) -> list[dict]:
    if isinstance(param_groups, dict):
        return [param_groups]
    if isinstance(param_groups, (list, tuple)) and all(isinstance(g, dict) for g in param_groups):
        return list(param_groups)
    raise ValueError(
        "split_params_into_different_moe_groups_for_optimizer(param_groups=...) takes a parameter-group dict "
        f"or a list/tuple of them, got {type(param_groups).__name__}"
    )


def _chunks(params: list[torch.nn.Parameter], max_numel: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive runs of ``params`` of at most ``max_numel`` elements (a larger parameter alone)."""
    out: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        if not out or (size + p.numel() > max_numel and out[-1]):
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel()
    return out


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: Any, max_group_size: int | None = DEFAULT_MAX_GROUP_SIZE
) -> list[dict]:
    """Move expert parameters out of ``param_groups`` into groups of their own.

    Each input group keeps its shared parameters; its expert parameters go to new groups with the same
    options plus ``moe: True`` and ``name`` set to the expert group name, one group per expert group (split
    further so that no group exceeds ``max_group_size`` elements, when given).
    """
    groups = _as_group_list(param_groups)
    out: list[dict] = []
    moe_groups: list[dict] = []
    for group in groups:
        shared: list[torch.nn.Parameter] = []
        by_name: dict[str, list[torch.nn.Parameter]] = {}
        for p in group["params"]:
            name = expert_group_of(p)
            if name is None:
                shared.append(p)
            else:
                by_name.setdefault(name, []).append(p)
        out.append({**group, "params": shared})
        for name in sorted(by_name):
            pieces = _chunks(by_name[name], max_group_size) if max_group_size else [by_name[name]]
            for piece in pieces:
                moe_groups.append({**group, "params": piece, "moe": True, "name": name})
    return out + moe_groups


def has_moe_layers(module: torch.nn.Module) -> tuple[bool, int]:
    """``(has_moe, num_experts)`` of the first MoE layer found in ``module``."""
    for sub in module.modules():
        if isinstance(sub, MoECore):
            return True, sub.num_experts
    return False, 0


def moe_layers(module: torch.nn.Module) -> list[Any]:
    """Every MoE layer of ``module``, in module order."""
    return [m for m in module.modules() if isinstance(m, MoECore)]


def check_zero_param_groups(param_groups: Sequence[dict], stage: int) -> None:
    """ZeRO-1/2 with expert parameters: every expert parameter must sit in a ``moe`` group of its own name."""
    if not any(is_moe_param(p) for g in param_groups for p in g["params"]):
        return
    if not any(is_moe_param_group(g) for g in param_groups):
        raise ValueError(
            f"ZeRO stage {stage}: the model has MoE layers but no optimizer parameter group is marked 'moe'; build "
            "the optimizer over deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(...)"
        )
    for index, group in enumerate(param_groups):
        names = {expert_group_of(p) for p in group["params"]}
        if is_moe_param_group(group):
            if names != {group.get("name")}:
                raise ValueError(
                    f"ZeRO stage {stage}: optimizer parameter group {index} is marked 'moe' with name "
                    f"{group.get('name')!r} but holds parameters of expert groups {sorted(map(str, names))}"
                )
        elif any(n is not None for n in names):
            raise ValueError(
                f"ZeRO stage {stage}: optimizer parameter group {index} mixes expert and shared parameters; "
                "split it with deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(...)"
            )


@dataclass(frozen=True)
class ExpertGroup:
    """The process groups of one expert group: the exchange group and the one expert gradients reduce over."""

    name: str
    ep_group: Any
    edp_group: Any


def by_reduce_group(params: Sequence[torch.nn.Parameter]) -> list[tuple[str | None, list[torch.nn.Parameter]]]:
    """``params`` split into shared ones (name ``None``, first) and one list per expert group (sorted names).

    The order is the same on every rank, which the collectives issued per part rely on.
    """
    shared: list[torch.nn.Parameter] = []
    experts: dict[str, list[torch.nn.Parameter]] = {}
    for p in params:
        name = expert_group_of(p)
        if name is None:
            shared.append(p)
        else:
            experts.setdefault(name, []).append(p)
    return [(None, shared)] + [(name, experts[name]) for name in sorted(experts)]


def configure_moe_param_groups(model_parameters: Any) -> list[dict]:
    """Parameters (or parameter groups) with expert parameters moved into ``moe`` groups of their own.

    Used when the engine builds the optimizer itself, so that ZeRO-1/2 can partition expert groups apart.
    Groups that already are MoE-split are returned unchanged.
    """
    items = list(model_parameters)
    if items and all(isinstance(g, dict) for g in items):
        if any(is_moe_param_group(g) for g in items):
            return items
        return split_params_into_different_moe_groups_for_optimizer(items)
    if any(isinstance(g, dict) for g in items):
        raise ValueError("model_parameters mixes parameter-group dicts and bare parameters")
    return split_params_into_different_moe_groups_for_optimizer({"params": items})
