"""ZeRO-3 optimizer state in upstream's checkpoint format (``fp32_flat_groups``), with elastic loading.

Each rank's flat fp32 group is the concatenation of its shard of every parameter, ``ceil(numel/world)``
elements each, in group order: the layout ``zero_to_fp32`` expects. Loading rebuilds every parameter's
full values from all saved ranks' shards and re-slices them for the live world size, so resuming at the
same or another data-parallel size is one code path.
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed._core.config.zero import ZeroStageEnum
from deepspeed._core.layout.shards import Range, Stage3ParamLayout
from deepspeed._core.optim.stage12_state import restore_scaler_state, saved_loss_scaler
from deepspeed._core.optim.universal_state import UniversalGroupState, UniversalSlice, UniversalTarget, install

FP32_FLAT_GROUPS = "fp32_flat_groups"


def shard_state_dict(opt: Any, version: str) -> dict:
    """This rank's ZeRO-3 shard of ``opt`` (a ``Stage3Optimizer``) with upstream's keys (no ``ds_version``:
    the file's top level carries it)."""
    del version
    return {
        "zero_stage": ZeroStageEnum.weights,
        "loss_scaler": saved_loss_scaler(opt),
        "dynamic_loss_scale": bool(getattr(opt.loss_scaler, "dynamic", False)),
        "overflow": opt.overflow,
        "partition_count": opt.world_size,
        "optimizer_state_dict": opt.optimizer.state_dict(),
        FP32_FLAT_GROUPS: [grp.master.data.detach().cpu().clone() for grp in opt.groups],
    }


def _regroup(flats: list[torch.Tensor], numels: list[int], live_world: int, live_rank: int) -> torch.Tensor:
    """Rebuild each parameter from the saved ranks' flat groups and cut this rank's live shards.

    ``flats[r]`` is saved rank ``r``'s flat group; ``numels`` the group's parameter sizes in order.
    """
    saved_world = len(flats)
    pieces = []
    offset = 0
    for numel in numels:
        saved = Stage3ParamLayout(numel, saved_world)
        full = torch.cat([f[offset : offset + saved.partition_numel] for f in flats])[:numel]
        offset += saved.partition_numel
        live = Stage3ParamLayout(numel, live_world)
        rng = live.valid_range(live_rank)
        shard = torch.zeros(live.partition_numel, dtype=full.dtype)
        shard[: rng.size].copy_(full[rng.start : rng.end])
        pieces.append(shard)
    return torch.cat(pieces) if pieces else torch.zeros(0)


def load_shards(opt: Any, shards: list[dict], load_optimizer_states: bool, load_from_fp32_weights: bool) -> None:
    """Restore ``opt`` from every saved rank's ZeRO-3 shard (any saved world size)."""
    restore_scaler_state(opt, shards, "ZeRO-3")
    for g, grp in enumerate(opt.groups):
        numels = [s.numel for s in grp.states]
        if load_from_fp32_weights:
            flat = _regroup([s[FP32_FLAT_GROUPS][g].float() for s in shards], numels, opt.world_size, opt.rank)
            grp.master.data.copy_(flat.to(grp.master.device))
    if load_optimizer_states:
        _load_inner_state(opt, shards)
    if load_from_fp32_weights:
        opt.write_back()


def _load_inner_state(opt: Any, shards: list[dict]) -> None:
    saved = shards[0]["optimizer_state_dict"]
    state: dict[int, dict[str, Any]] = {}
    for g, grp in enumerate(opt.groups):
        numels = [s.numel for s in grp.states]
        entry = {}
        for key, value in saved["state"].get(g, {}).items():
            if torch.is_tensor(value) and value.dim() == 1:  # shard-shaped moments; 0-d = step count
                flats = [s["optimizer_state_dict"]["state"][g][key] for s in shards]
                entry[key] = _regroup(flats, numels, opt.world_size, opt.rank).to(value.dtype)
            else:
                entry[key] = value
        state[g] = entry
    opt.optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def universal_targets(opt: Any) -> list[UniversalTarget]:
    """Per group: each parameter's shard of this rank, back to back in the flat master."""
    targets = []
    for grp in opt.groups:
        pieces = []
        for state, offset in zip(grp.states, grp.offsets, strict=True):
            valid = state.layout.valid_range(opt.rank)
            pieces.append(UniversalSlice(state.param, valid, Range(offset, offset + valid.size)))
        targets.append(UniversalTarget(grp.master.param.numel(), tuple(pieces)))
    return targets


def load_universal(opt: Any, states: list[UniversalGroupState], global_state: dict) -> None:
    """Install universal values read for :func:`universal_targets`, then write the masters into the shards."""
    install(opt, [grp.master.param.data for grp in opt.groups], states, global_state)
    opt.write_back()
