"""MoE checkpoint layout: expert weights in files of their own, named by global expert id.

Beside the usual model-states file (which then holds only the shared parameters), every expert of
every MoE layer is saved to ``layer_<L>_expert_<E>_mp_rank_<MP>_model_states.pt`` with its keys spelled
with the *global* expert id ``E = ep_rank * num_local_experts + local_id`` (``L`` counts MoE layers in
module order). Ranks holding the same experts (one expert-data-parallel group) write them once, from
expert-data-parallel rank 0. Without ZeRO the optimizer state differs between expert-parallel ranks,
so it goes to ``expp_rank_<ep_rank>_mp_rank_<MP>_optim_states.pt`` instead of the model-states file.
Loading reverses the renaming, so a rank reads exactly the experts it holds.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

EXPERTS_INFIX = "deepspeed_moe.experts.deepspeed_experts."


@dataclasses.dataclass(frozen=True)
class MoELayerInfo:
    """One MoE layer: its id, the module path of its experts' container and its local expert count."""

    layer_id: int
    prefix: str  # e.g. "blocks.1.moe." (empty for a bare MoE module)
    num_local_experts: int
    ep_rank: int  # this rank's index in the layer's expert-parallel group
    edp_rank: int  # this rank's index in the layer's expert-data-parallel group


@dataclasses.dataclass(frozen=True)
class MoECheckpointLayout:
    """Where this rank sits among the experts, and the model's MoE layers.

    ``ep_rank`` / ``edp_rank`` are taken in the largest expert-parallel group; they name and elect the
    writer of the stage-0 optimizer file.
    """

    ep_rank: int
    edp_rank: int
    layers: tuple[MoELayerInfo, ...]


def describe(
    module: torch.nn.Module, moe_class: type[Any], ranks_of: dict[str, tuple[int, int]], max_group: str
) -> MoECheckpointLayout:
    """The layout of ``module``'s MoE layers (instances of ``moe_class``) for this rank.

    ``ranks_of`` maps an expert group name to this rank's ``(ep_rank, edp_rank)`` in it.
    """
    layers: list[MoELayerInfo] = []
    for name, sub in module.named_modules():
        if isinstance(sub, moe_class):
            ep_rank, edp_rank = ranks_of[sub.expert_group_name]
            layers.append(
                MoELayerInfo(len(layers), f"{name}." if name else "", sub.num_local_experts, ep_rank, edp_rank)
            )
    ep_rank, edp_rank = ranks_of[max_group]
    return MoECheckpointLayout(ep_rank, edp_rank, tuple(layers))


def expert_file_name(layer_id: int, expert_id: int, mp_rank: int) -> str:
    """File of global expert ``expert_id`` of MoE layer ``layer_id``."""
    return f"layer_{layer_id}_expert_{expert_id}_mp_rank_{mp_rank:02d}_model_states.pt"


def expert_optim_file_name(ep_rank: int, mp_rank: int) -> str:
    """Stage-0 optimizer state of expert-parallel rank ``ep_rank``."""
    return f"expp_rank_{ep_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def _match(key: str, layer: MoELayerInfo) -> tuple[int, str] | None:
    """``(local expert id, rest of the key)`` when ``key`` belongs to an expert of ``layer``."""
    head = layer.prefix + EXPERTS_INFIX
    if not key.startswith(head):
        return None
    found = re.match(r"(\d+)\.(.*)", key[len(head) :])
    return (int(found.group(1)), found.group(2)) if found else None


def split_state(state: dict, layout: MoECheckpointLayout) -> tuple[dict, dict[tuple[int, int], dict]]:
    """``(shared entries, {(layer id, global expert id): entries with global-id keys})`` of a module state.

    Only the experts this rank must write are returned (edp rank 0 of their layer's group).
    """
    shared: Any = type(state)()  # keeps the state's mapping type (and its _metadata below)
    experts: dict[tuple[int, int], dict] = {}
    for key, value in state.items():
        for layer in layout.layers:
            hit = _match(key, layer)
            if hit is not None:
                local, rest = hit
                global_id = layer.ep_rank * layer.num_local_experts + local
                if layer.edp_rank != 0:
                    break
                experts.setdefault((layer.layer_id, global_id), {})[
                    f"{layer.prefix}{EXPERTS_INFIX}{global_id}.{rest}"
                ] = value
                break
        else:
            shared[key] = value
    if hasattr(state, "_metadata"):
        shared._metadata = state._metadata
    return shared, experts


def wanted_expert_files(layout: MoECheckpointLayout, mp_rank: int) -> list[tuple[MoELayerInfo, int, str]]:
    """``(layer, local id, file name)`` of every expert this rank holds."""
    out = []
    for layer in layout.layers:
        for local in range(layer.num_local_experts):
            global_id = layer.ep_rank * layer.num_local_experts + local
            out.append((layer, local, expert_file_name(layer.layer_id, global_id, mp_rank)))
    return out


def localise(expert_state: dict, layer: MoELayerInfo, local: int) -> dict:
    """An expert file's entries re-keyed to this rank's local expert index."""
    head = layer.prefix + EXPERTS_INFIX
    out = {}
    for key, value in expert_state.items():
        hit = _match(key, layer)
        if hit is None:
            raise ValueError(f"expert checkpoint entry {key!r} does not belong to MoE layer '{head}'")
        out[f"{head}{local}.{hit[1]}"] = value
    return out
