"""ZeRO-1/2 optimizer state in upstream's checkpoint format, with elastic (any world size) loading.

Saving writes this rank's shard with upstream's keys ([Note: checkpoint keys] in docs/checkpoints.md):
the fp32 partition with its data-parallel padding removed, the inner optimizer's state, paddings and
partition counts. Loading always rebuilds each group's full unpadded vectors from every saved rank's
valid range and re-slices them for the live layout, so the same code serves resume at the same world
size and resume at another one (2→1, 2→4, 4→2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepspeed._core.config.zero import ZeroStageEnum
from deepspeed._core.layout.shards import GroupLayout
from deepspeed._core.optim.loss_scaling import LossScaler
from deepspeed._core.optim.universal_state import UniversalGroupState, UniversalSlice, UniversalTarget, install
from deepspeed._foundation.logging import logger


@dataclass
class fragment_address:
    """Where a parameter's fragment sits inside a rank's flat partition (``param_slice_mappings`` values)."""

    numel: int
    start: int


# Pickles must name upstream's path so that either implementation can read the other's files.
fragment_address.__module__ = "deepspeed.utils.tensor_fragment"

SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
BASE_OPTIMIZER_STATE_STEP = "base_optimizer_state_step"
PARAM_ALIGNMENT_PADDINGS = "param_alignment_paddings"
# Everything ZenFlow holds between steps (``zero_optimization.zenflow``; [Note: zenflow checkpoint]).
ZENFLOW_STATE = "zenflow_state"
ZENFLOW_FRESH = (
    "zero_optimization.zenflow: the load brings no ZenFlow state (the checkpoint was saved with zenflow off or is "
    "a universal checkpoint, or its optimizer states were not loaded): ZenFlow starts afresh from the loaded weights "
    "and optimizer state, with an empty gradient accumulator and columns selected at the next step"
)


def saved_loss_scaler(opt: Any) -> LossScaler:
    """The scaler object a shard records: the live one, or a fixed scale of 1 when the run has none (fp32, bf16).

    Upstream always pickles a scaler object here and reads its attributes on load, so ``None`` would not do.
    """
    return opt.loss_scaler if opt.loss_scaler is not None else LossScaler(1.0)


def shard_state_dict(opt: Any, version: str) -> dict:
    """This rank's ZeRO-1/2 shard of ``opt`` (a ``ZeroOptimizer``) with upstream's keys."""
    if getattr(opt, "zenflow", None) is not None:
        opt.zenflow.sync_columns()  # the masters and moments of ZenFlow's device columns, current on the host
    groups = opt.groups
    shard = {
        "loss_scaler": saved_loss_scaler(opt),
        "dynamic_loss_scale": bool(getattr(opt.loss_scaler, "dynamic", False)),
        "overflow": opt.overflow,
        "clip_grad": opt.plan.grads.clip_norm,
        BASE_OPTIMIZER_STATE: opt.optimizer.state_dict(),
        SINGLE_PARTITION_OF_FP32_GROUPS: [_valid(g.flat.layout, g.rank, g.master.param.data) for g in groups],
        "zero_stage": ZeroStageEnum(opt.plan.zero.stage),
        "group_paddings": [g.flat.layout.upstream_group_padding(g.rank) for g in groups],
        # Per group, the padding put after each parameter to align it: none here (parameters are packed
        # back to back). Upstream's reader refuses a file whose list differs from its own layout's.
        PARAM_ALIGNMENT_PADDINGS: [[0] * len(g.names) for g in groups],
        # MoE groups are partitioned over their expert-data-parallel group, hence a count per group.
        "partition_count": [g.flat.layout.world_size for g in groups],
        "ds_version": version,
        "param_slice_mappings": [_slice_mappings(g, g.rank) for g in groups],
    }
    if getattr(opt, "zenflow", None) is not None:  # this package's own key; upstream's reader ignores it
        shard[ZENFLOW_STATE] = _zenflow_shard(opt)
    return shard


def _zenflow_shard(opt: Any) -> dict:
    """ZenFlow's state ([Note: zenflow checkpoint]), its partition-shaped tensors without the padding."""
    state = opt.zenflow.state_dict(working=lambda index: _working_partition(opt.groups[index]))
    state["partitions"] = {
        key: [_valid(g.flat.layout, g.rank, t) for g, t in zip(opt.groups, tensors, strict=True)]
        for key, tensors in state["partitions"].items()
    }
    return state


def _working_partition(group: Any) -> torch.Tensor:
    """This rank's partition of ``group``'s working flat buffer, in the working dtype, on the host."""
    writer = group.master.writer
    out = torch.empty(writer.partition.size, dtype=writer.flat.dtype)
    writer.read(out)
    return out


def _valid(layout: GroupLayout, rank: int, partition: torch.Tensor) -> torch.Tensor:
    """``partition`` (this rank's padded slice) without the tail padding, on the host."""
    return partition[: layout.valid_range(rank).size].detach().cpu().clone()


def _slice_mappings(group: Any, rank: int) -> dict[str, fragment_address]:
    """Where each parameter fragment of this partition starts (partition-relative) and its size."""
    out = {}
    for frag in group.flat.layout.params_in_partition(rank):
        name = group.names[frag.slot.index]
        out[name] = fragment_address(numel=frag.partition_range.size, start=frag.partition_range.start)
    return out


def _full_vector(pieces: list[torch.Tensor], numel: int) -> torch.Tensor:
    """Concatenate saved valid ranges (rank order) and check they cover exactly ``numel`` elements."""
    full = torch.cat([p.reshape(-1).float() for p in pieces]) if pieces else torch.zeros(0)
    if full.numel() < numel:
        raise ValueError(f"saved ZeRO shards hold {full.numel()} elements but the group has {numel}")
    return full[:numel]


def _reslice(full: torch.Tensor, layout: GroupLayout, rank: int, like: torch.Tensor) -> torch.Tensor:
    """This rank's padded partition of the unpadded ``full`` vector, shaped and typed like ``like``."""
    out = torch.zeros_like(like)
    valid = layout.valid_range(rank)
    start = layout.partition(rank).start
    out[: valid.size].copy_(full[start : start + valid.size])
    return out


def _saved_valid_states(shards: list[dict], group_index: int, key: str) -> list[torch.Tensor]:
    """Per saved rank: the inner-optimizer state tensor ``key`` of ``group_index``, padding removed."""
    pieces = []
    for shard in shards:
        state = shard[BASE_OPTIMIZER_STATE]["state"][group_index][key]
        valid = shard[SINGLE_PARTITION_OF_FP32_GROUPS][group_index].numel()
        pieces.append(state.reshape(-1)[:valid])
    return pieces


def restore_scaler_state(opt: Any, shards: list[dict], stage_name: str) -> None:
    """Common prologue of ZeRO loads: every shard present, loss scaler and overflow flag from rank 0's."""
    if any(s is None for s in shards):
        raise ValueError(f"{stage_name} loading needs every saved rank's optimizer shard")
    first = shards[0]
    if first.get("loss_scaler") is not None and opt.loss_scaler is not None:
        opt.loss_scaler = first["loss_scaler"]
    opt.overflow = bool(first.get("overflow", False))


def load_shards(opt: Any, shards: list[dict], load_optimizer_states: bool, load_from_fp32_weights: bool) -> None:
    """Restore ``opt`` from every saved rank's shard (any saved world size)."""
    check_shards(shards)
    restore_scaler_state(opt, shards, "ZeRO-1/2")
    for g, group in enumerate(opt.groups):
        layout = group.flat.layout
        if load_from_fp32_weights:
            mine = _group_shards(group, shards, g)
            full = _full_vector([s[SINGLE_PARTITION_OF_FP32_GROUPS][g] for s in mine], layout.numel)
            master = group.master.param.data
            master.copy_(_reslice(full, layout, group.rank, master).to(master.device))
        else:
            group.master.refresh()
    if load_optimizer_states:
        _load_inner_state(opt, shards)
    if getattr(opt, "zenflow", None) is not None:
        _load_zenflow(opt, shards if load_optimizer_states else [])
    elif any(ZENFLOW_STATE in s for s in shards):
        logger.info("the checkpoint's ZenFlow state is not used: zero_optimization.zenflow is off in this run")
    opt.publish_weights()


def check_zenflow_shards(opt: Any, shards: list) -> None:
    """Refuse ZenFlow state that cannot be restored into ``opt``, before anything is loaded."""
    saved: list[Any] = [(s or {}).get(ZENFLOW_STATE) for s in shards]
    if getattr(opt, "zenflow", None) is None or all(z is None for z in saved):
        return
    widths = {tuple(z["column_widths"]) if z is not None else None for z in saved}
    live = tuple(opt.zenflow.widths)
    if None in widths or widths != {live} or any(len(z["step_counts"]) != len(opt.groups) for z in saved if z):
        raise ValueError(
            f"zero_optimization.zenflow: the checkpoint's '{ZENFLOW_STATE}' does not fit this run (missing on some "
            f"ranks, or saved for other 2-D weights or parameter groups: {len(widths)} distinct layouts for "
            f"{len(live)} 2-D weights and {len(opt.groups)} groups here); load it with the model and parameter "
            "groups it was saved with"
        )


def _load_zenflow(opt: Any, shards: list[dict]) -> None:
    """Restore ZenFlow's state, its partition-shaped tensors re-sliced for this run's partitions (any saved
    world size); a checkpoint without it starts ZenFlow afresh, saying so."""
    if not shards or any(ZENFLOW_STATE not in s for s in shards):
        logger.warning(ZENFLOW_FRESH)
        opt.zenflow.start_fresh()
        return
    saved: list[dict] = [s[ZENFLOW_STATE] for s in shards]
    parts = {}
    for key, first in saved[0]["partitions"].items():
        per_group = []
        for g, group in enumerate(opt.groups):
            layout = group.flat.layout
            full = _full_vector([z["partitions"][key][g] for z in saved], layout.numel)
            like = torch.empty(group.master.param.numel(), dtype=first[g].dtype)
            per_group.append(_reslice(full, layout, group.rank, like))
        parts[key] = per_group
    opt.zenflow.load_state_dict({**saved[0], "partitions": parts})


def check_shards(shards: list) -> None:
    """Refuse shards this format cannot read, before anything is loaded.

    Files whose flat groups pad between parameters (upstream's ``zero_optimization.parameter_alignment``) are
    sliced differently; reading them as packed would silently misplace every value after the first padding.
    """
    for shard in shards:
        paddings = (shard or {}).get(PARAM_ALIGNMENT_PADDINGS) or []
        if any(any(group) for group in paddings):
            raise ValueError(
                f"the ZeRO checkpoint's '{PARAM_ALIGNMENT_PADDINGS}' are not all 0: it was saved with "
                "zero_optimization.parameter_alignment, whose padded layout this package cannot read; save it "
                "without that setting, or convert it with upstream's ds_to_universal and load it with "
                "checkpoint.load_universal"
            )


def _partition_count(shard: dict, index: int, default: int) -> int:
    """Saved partition count of group ``index`` (a list per group; an int or nothing in some writers' files)."""
    count = shard.get("partition_count", default)
    if isinstance(count, (list, tuple)):
        return int(count[index]) if index < len(count) else default
    return int(count)


def _group_shards(group: Any, shards: list[dict], index: int) -> list[dict]:
    """The saved shards that hold pieces of flat group ``index``: all of them for a data-parallel group; for
    an MoE group partitioned over fewer ranks, those of the live group's members (same world size only)."""
    counts = {_partition_count(s, index, len(shards)) for s in shards}
    if counts == {len(shards)}:
        return shards
    if len(shards) < max(group.member_ranks, default=0) + 1 or counts != {len(group.member_ranks)}:
        raise ValueError(
            f"optimizer group {index} (an MoE expert group) was saved partitioned over {sorted(counts)} ranks of a "
            f"{len(shards)}-rank run; it can only be resumed with the same world size and expert-parallel size"
        )
    return [shards[r] for r in group.member_ranks]


def _load_inner_state(opt: Any, shards: list[dict]) -> None:
    saved = shards[0][BASE_OPTIMIZER_STATE]
    state: dict[int, dict[str, Any]] = {}
    for g, group in enumerate(opt.groups):
        layout = group.flat.layout
        master = group.master.param.data
        entry = {}
        for key, value in saved["state"].get(g, {}).items():
            if torch.is_tensor(value) and value.dim() == 1:  # partition-shaped (moments); 0-d = step count
                full = _full_vector(_saved_valid_states(_group_shards(group, shards, g), g, key), layout.numel)
                entry[key] = _reslice(full, layout, group.rank, master).to(value.dtype)
            else:
                entry[key] = value  # scalars such as Adam's step count are identical on every rank
        state[g] = entry
    opt.optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def universal_targets(opt: Any) -> list[UniversalTarget]:
    """Per flat group: the parameter pieces in this rank's partition ([Note: universal load])."""
    targets = []
    for group in opt.groups:
        frags = group.flat.layout.params_in_partition(group.rank)
        pieces = tuple(UniversalSlice(group.params[f.slot.index], f.param_range, f.partition_range) for f in frags)
        targets.append(UniversalTarget(group.master.param.numel(), pieces))
    return targets


def load_universal(opt: Any, states: list[UniversalGroupState], global_state: dict) -> None:
    """Install universal values read for :func:`universal_targets`, then all-gather the new weights."""
    install(opt, [g.master.param.data for g in opt.groups], states, global_state)
    if getattr(opt, "zenflow", None) is not None:  # a universal checkpoint has no per-rank ZenFlow state
        logger.warning(ZENFLOW_FRESH)
        opt.zenflow.start_fresh()
    opt.publish_weights()
