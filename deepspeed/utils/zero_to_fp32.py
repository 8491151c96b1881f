#!/usr/bin/env python
"""Rebuild full fp32 weights from a ZeRO (stage 1, 2 or 3) checkpoint, without a process group.

ZeRO checkpoints hold each parameter's fp32 master value split across the data-parallel ranks'
optimizer files. This module concatenates the pieces back into one ``{name: tensor}`` state dict.
It is also a standalone script: ``save_checkpoint`` copies it into every ZeRO checkpoint folder, so

    python zero_to_fp32.py <checkpoint_dir> <output_dir> [--safe_serialization] [--max_shard_size 5GB]

works later with any installed ``deepspeed`` (it needs only ``deepspeed.utils.logger`` and
``deepspeed.checkpoint.constants``).

Layout read (see ``docs/checkpoints.md``): ``<checkpoint_dir>/latest`` names the tag; the tag folder
holds ``*_model_states.pt`` (parameter names and shapes per optimizer group, buffers, frozen and tied
parameters) and ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (rank ``r``'s fp32 partition).
A pipeline checkpoint has one ``mp_rank_<SS>`` model file and shard set per stage, plus per-layer
``layer_<NN>-model_states.pt`` files (buffers are read from those); the stages' parameters are merged.

* Stages 1-2: per group, the ranks' ``single_partition_of_fp32_groups`` entries laid end to end form
  the group's flat fp32 buffer; parameters follow one another in ``param_shapes`` order.
* Stage 3: every parameter owns ``ceil(numel / world)`` elements of each rank's ``fp32_flat_groups``
  buffer (the last rank's share is padded); its value is the ranks' shares concatenated and truncated.

Files are read with ``torch.load(weights_only=True)`` plus an allow-list of DeepSpeed's loss-scaler
and ZeRO-stage classes; set ``DS_CHECKPOINT_TRUSTED=1`` to read a trusted file that holds other objects.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from deepspeed.checkpoint.constants import (
    BUFFER_NAMES,
    DS_VERSION,
    FP32_FLAT_GROUPS,
    FROZEN_PARAM_FRAGMENTS,
    FROZEN_PARAM_SHAPES,
    OPTIMIZER_STATE_DICT,
    PARAM_SHAPES,
    PARTITION_COUNT,
    SINGLE_PARTITION_OF_FP32_GROUPS,
    ZERO_STAGE,
)
from deepspeed.utils import logger

TRUST_ENV = "DS_CHECKPOINT_TRUSTED"
_MODEL_FILE = re.compile(r"^(zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_FILE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
_EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_EXPERTS_INFIX = "deepspeed_moe.experts.deepspeed_experts."

_LAYER_FILE = re.compile(r"^layer_(\d+)(-.+)?-model_states\.pt$")
# Classes DeepSpeed pickles into checkpoints; looked up by import path so any deepspeed version works.
_SAFE_CLASSES = {
    "deepspeed.runtime.fp16.loss_scaler": ("LossScalerBase", "LossScaler", "DynamicLossScaler"),
    "deepspeed.runtime.zero.config": ("ZeroStageEnum",),
    "deepspeed.utils.tensor_fragment": ("fragment_address",),
}


# --- file access --------------------------------------------------------------------------------
def _allowed_classes() -> list[Any]:
    found: list[Any] = []
    for module_name, names in _SAFE_CLASSES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        found.extend(getattr(module, n) for n in names if hasattr(module, n))
    return found


def _load(path: str, mmap: bool = False) -> Any:
    """Load one checkpoint file on CPU; errors name the file."""
    trusted = os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    try:
        if trusted:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
        with torch.serialization.safe_globals(_allowed_classes()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:
        hint = f" (set {TRUST_ENV}=1 only if you trust this file)" if "global" in str(err).lower() else ""
        raise RuntimeError(f"cannot read checkpoint file '{path}': {str(err).splitlines()[0]}{hint}") from err


def _resolve_tag_dir(checkpoint_dir: str, tag: str | None) -> str:
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            raise ValueError(f"no tag given and no 'latest' file at '{latest}'; pass tag=... (e.g. 'global_step100')")
        with open(latest, encoding="utf-8") as f:
            tag = f.read().strip()
    tag_dir = os.path.join(checkpoint_dir, str(tag))
    if not os.path.isdir(tag_dir):
        raise FileNotFoundError(f"checkpoint folder '{tag_dir}' does not exist")
    return tag_dir


def _ranked_files(tag_dir: str, pattern: re.Pattern, what: str, mp_rank: int = 0) -> list[str]:
    """Files in ``tag_dir`` matching ``pattern`` for model-parallel rank ``mp_rank``, ordered by data-parallel rank."""
    ranked = []
    for name in os.listdir(tag_dir):
        m = pattern.match(name)
        if m and int(m.group(3)) == mp_rank:
            ranked.append((int(m.group(2) or 0), name))
    if not ranked:
        raise FileNotFoundError(f"no {what} files in '{tag_dir}'; is this a ZeRO checkpoint folder?")
    ranks = [r for r, _ in sorted(ranked)]
    if ranks != list(range(len(ranks))):
        raise ValueError(f"{what} files in '{tag_dir}' have ranks {ranks}; expected 0..{len(ranks) - 1}")
    return [os.path.join(tag_dir, n) for _, n in sorted(ranked)]


def get_model_state_file(checkpoint_dir: str, zero_stage: int) -> str:
    """Path of rank 0's model-states file in the tag folder ``checkpoint_dir`` (Lightning reads its client state).

    Stages 0-2 write ``mp_rank_00_model_states.pt``; stage 3 writes one per rank, rank 0's being
    ``zero_pp_rank_0_mp_rank_00_model_states.pt``.
    """
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"checkpoint folder '{checkpoint_dir}' does not exist")
    name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if int(zero_stage) == 3 else "mp_rank_00_model_states.pt"
    path = os.path.join(checkpoint_dir, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no model states file '{path}' (zero_stage={zero_stage})")
    return path


def get_optim_files(checkpoint_dir: str) -> list[str]:
    """Every rank's ``*_optim_states.pt`` in the tag folder ``checkpoint_dir``, in data-parallel rank order."""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"checkpoint folder '{checkpoint_dir}' does not exist")
    return _ranked_files(checkpoint_dir, _OPTIM_FILE, "optimizer state")


def _layer_files(tag_dir: str) -> dict[int, str]:
    """Pipeline per-layer files ``{global layer index: path}`` (empty for a checkpoint without pipeline)."""
    found = {}
    for name in os.listdir(tag_dir):
        m = _LAYER_FILE.match(name)
        if m:
            if m.group(2):
                raise ValueError(f"'{name}': tensor-parallel pipeline checkpoints are not supported by zero_to_fp32")
            found[int(m.group(1))] = os.path.join(tag_dir, name)
    return found


def _model_parallel_ranks(tag_dir: str) -> list[int]:
    """The ``mp_rank_XX`` values present; several only for pipeline checkpoints (one per stage)."""
    ranks = sorted({int(m.group(3)) for n in os.listdir(tag_dir) if (m := _MODEL_FILE.match(n))})
    if len(ranks) > 1 and not _layer_files(tag_dir):
        raise ValueError(
            f"'{tag_dir}' holds model-parallel ranks {ranks}: tensor-parallel checkpoints are not "
            "supported by zero_to_fp32 (pipeline checkpoints are)"
        )
    return ranks or [0]


# --- parsed checkpoint --------------------------------------------------------------------------
@dataclass
class ZeroModelState:
    """What one ``*_model_states.pt`` file contributes."""

    buffers: dict
    param_shapes: list
    shared_params: Any
    ds_version: Any
    frozen_param_shapes: dict | None
    frozen_param_fragments: dict | None


@dataclass
class ZeroShards:
    """The fp32 partitions of every rank: ``groups[rank][group]`` (stage 3: one flat tensor per rank)."""

    stage: int
    world_size: int
    groups: list = field(default_factory=list)
    # Ranks each group is partitioned over (stages 1-2); fewer than world_size for MoE expert groups.
    partition_counts: list = field(default_factory=list)


def _pipeline_module_state(tag_dir: str) -> dict:
    """A pipeline stage's weights live in per-layer files; their keys gain the ``<layer index>.`` prefix."""
    state = {}
    for idx, path in sorted(_layer_files(tag_dir).items()):
        state.update({f"{idx}.{k}": v for k, v in _load(path).items()})
    return state


def _parse_model_file(path: str) -> ZeroModelState:
    sd = _load(path)
    if BUFFER_NAMES not in sd:
        raise ValueError(f"'{path}' has no '{BUFFER_NAMES}' entry; it is not a DeepSpeed model-states file")
    names = set(sd[BUFFER_NAMES])
    module = sd["module"] if sd["module"] is not None else _pipeline_module_state(os.path.dirname(path))
    buffers = {k: (v.float() if v.is_floating_point() else v) for k, v in module.items() if k in names}
    return ZeroModelState(
        buffers=buffers,
        param_shapes=sd.get(PARAM_SHAPES) or [],
        shared_params=sd.get("shared_params") or {},
        ds_version=sd.get(DS_VERSION),
        frozen_param_shapes=sd.get(FROZEN_PARAM_SHAPES),
        frozen_param_fragments=sd.get(FROZEN_PARAM_FRAGMENTS),
    )


def _refuse_aligned(states: list[dict], paths: list[str]) -> None:
    """Files saved with ``zero_optimization.parameter_alignment`` pad between parameters; read as packed, every value
    after the first padding would land in the wrong parameter."""
    key = "param_alignment_paddings"
    for state, path in zip(states, paths, strict=True):
        if any(any(group) for group in state.get(key) or []):
            raise ValueError(
                f"'{path}': its '{key}' are not all 0 (saved with zero_optimization.parameter_alignment); "
                "this script cannot consolidate that layout"
            )


def _parse_optim_files(paths: list[str]) -> ZeroShards:
    states = [_load(p, mmap=True)[OPTIMIZER_STATE_DICT] for p in paths]
    first = states[0]
    if ZERO_STAGE in first:
        stage = int(first[ZERO_STAGE])
    elif SINGLE_PARTITION_OF_FP32_GROUPS in first:
        stage = 1  # the bf16 stage-1 optimizer writes the stage-1 layout without a stage entry
    else:
        raise ValueError(f"'{paths[0]}' is not a ZeRO optimizer file (no '{ZERO_STAGE}' entry)")
    count = first.get(PARTITION_COUNT, len(paths))
    world = max(count) if isinstance(count, (list, tuple)) else int(count)
    if world != len(paths):
        raise ValueError(f"expected {world} optimizer files (partition_count) but found {len(paths)}: {paths}")
    groups: list[list[torch.Tensor]] | list[torch.Tensor]
    if stage <= 2:
        _refuse_aligned(states, paths)
        groups = [list(s[SINGLE_PARTITION_OF_FP32_GROUPS]) for s in states]
    else:
        groups = [torch.cat([t.reshape(-1) for t in s[FP32_FLAT_GROUPS]]) for s in states]
    counts = list(count) if isinstance(count, (list, tuple)) else [world] * len(groups[0] if stage <= 2 else [])
    return ZeroShards(stage=stage, world_size=world, groups=groups, partition_counts=counts)


def _expert_layers(tag_dir: str) -> dict[str, int]:
    """MoE checkpoints: ``{module prefix of a layer's experts: number of experts}`` from the expert files."""
    per_layer: dict[int, list[str]] = {}
    for name in os.listdir(tag_dir):
        m = _EXPERT_FILE.match(name)
        if m:
            per_layer.setdefault(int(m.group(1)), []).append(name)
    prefixes = {}
    for names in per_layer.values():
        key = next(iter(_load(os.path.join(tag_dir, names[0]))), "")
        prefixes[key[: key.find(_EXPERTS_INFIX)]] = len(names)
    return prefixes


def _global_expert_name(name: str, ep_rank: int, ep_size: int, layers: dict[str, int]) -> str:
    """``name`` of a local expert parameter on expert-parallel rank ``ep_rank``, spelled with its global id."""
    at = name.find(_EXPERTS_INFIX)
    prefix = name[:at]
    if at < 0 or prefix not in layers:
        raise ValueError(f"'{name}' is in an MoE optimizer group but matches no layer_*_expert_* file")
    local, rest = name[at + len(_EXPERTS_INFIX) :].split(".", 1)
    global_id = ep_rank * (layers[prefix] // ep_size) + int(local)
    return f"{prefix}{_EXPERTS_INFIX}{global_id}.{rest}"


# --- lazy full tensors --------------------------------------------------------------------------
class GatheredTensor:
    """A full tensor described by pieces of rank-local buffers; ``contiguous()`` builds it.

    Returned by ``lazy_mode=True`` so a caller can materialize one parameter at a time.
    """

    def __init__(self, pieces: list[tuple[torch.Tensor, int, int]], shape: torch.Size) -> None:
        self.pieces = pieces
        self.shape = torch.Size(shape)
        self.dtype = pieces[0][0].dtype if pieces else torch.float32

    def numel(self) -> int:
        """Element count of the full tensor."""
        return math.prod(self.shape)

    def contiguous(self) -> torch.Tensor:
        """The full tensor (a new, compact CPU tensor)."""
        if not self.pieces:
            return torch.empty(self.shape, dtype=self.dtype)
        flat = torch.cat([buf.reshape(-1).narrow(0, start, length) for buf, start, length in self.pieces])
        return flat.reshape(self.shape).clone()


def _pieces_across(buffers: list[torch.Tensor], start: int, length: int) -> list[tuple[torch.Tensor, int, int]]:
    """Pieces covering ``[start, start + length)`` of the buffers laid end to end."""
    pieces, base = [], 0
    for buf in buffers:
        size = buf.numel()
        lo, hi = max(start, base), min(start + length, base + size)
        if lo < hi:
            pieces.append((buf, lo - base, hi - lo))
        base += size
    return pieces


def _align(n: int, multiple: int) -> int:
    return multiple * math.ceil(n / multiple)


def _stage12_params(shards: ZeroShards, param_shapes: list, expert_layers: dict[str, int]) -> OrderedDict:
    out: OrderedDict = OrderedDict()
    for g, shapes in enumerate(param_shapes):
        count = shards.partition_counts[g] if g < len(shards.partition_counts) else shards.world_size
        if count == shards.world_size:
            out.update(_group_params(g, shapes, [rank_groups[g] for rank_groups in shards.groups], count))
            continue
        # An MoE group: partitioned over an expert-data-parallel group of `count` ranks. With expert-parallel
        # groups of consecutive ranks, expert-parallel rank j's group holds ranks j, j + P, j + 2P, ...
        ep_size = shards.world_size // count
        for ep_rank in range(ep_size):
            buffers = [shards.groups[r][g] for r in range(ep_rank, shards.world_size, ep_size)]
            renamed = OrderedDict(
                (_global_expert_name(n, ep_rank, ep_size, expert_layers), shape) for n, shape in shapes.items()
            )
            out.update(_group_params(g, renamed, buffers, count))
    return out


def _group_params(g: int, shapes: dict, buffers: list[torch.Tensor], world: int) -> OrderedDict:
    out: OrderedDict = OrderedDict()
    available = sum(b.numel() for b in buffers)
    offset = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        out[name] = GatheredTensor(_pieces_across(buffers, offset, numel), shape)
        offset += numel
    # Partitions may or may not include the alignment padding (2 x world elements) at the end.
    if _align(offset, 2 * world) != _align(available, 2 * world):
        raise ValueError(f"group {g}: parameters need {offset} elements but the partitions hold {available}")
    return out


def _stage3_params(shards: ZeroShards, param_shapes: list) -> OrderedDict:
    out: OrderedDict = OrderedDict()
    world = shards.world_size
    offset = 0
    for shapes in param_shapes:
        for name, shape in shapes.items():
            numel = math.prod(shape)
            share = math.ceil(numel / world)
            pieces = [(buf, offset, share) for buf in shards.groups]
            out[name] = GatheredTensor(_truncate(pieces, numel), shape)
            offset += share
    available = shards.groups[0].numel()
    if _align(offset * world, 2 * world) != _align(available * world, 2 * world):
        raise ValueError(f"parameters need {offset} elements per rank but each rank's partition holds {available}")
    return out


def _truncate(pieces: list[tuple[torch.Tensor, int, int]], numel: int) -> list[tuple[torch.Tensor, int, int]]:
    kept, left = [], numel
    for buf, start, length in pieces:
        if left <= 0:
            break
        kept.append((buf, start, min(length, left)))
        left -= length
    return kept


def _frozen_params(models: list[ZeroModelState], stage: int) -> OrderedDict:
    out: OrderedDict = OrderedDict()
    shapes = models[0].frozen_param_shapes or {}
    # A file that lists frozen shapes also holds their fragments (both are written or neither is).
    fragments = [m.frozen_param_fragments or {} for m in models]
    for name, shape in shapes.items():
        if stage <= 2:
            out[name] = fragments[0][name]
        else:
            numel = math.prod(shape)
            pieces = [(f[name], 0, f[name].numel()) for f in fragments]
            out[name] = GatheredTensor(_truncate(pieces, numel), shape)
    return out


def _add_shared(state: OrderedDict, shared: Any) -> None:
    pairs = shared.items() if isinstance(shared, dict) else shared
    for alias, owner in pairs:
        if owner in state:
            state[alias] = state[owner]


# --- public API ---------------------------------------------------------------------------------
def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str, tag: str | None = None, exclude_frozen_parameters: bool = False, lazy_mode: bool = False
) -> OrderedDict:
    """Return the consolidated ``{name: fp32 tensor}`` state dict of a ZeRO checkpoint (on CPU).

    Args:
        checkpoint_dir: the folder that holds ``latest`` and the tag folders.
        tag: tag folder to read (e.g. ``global_step14``); ``None`` reads the tag in ``latest``.
        exclude_frozen_parameters: leave out parameters that were not trained.
        lazy_mode: return :class:`GatheredTensor` values (call ``.contiguous()`` on each) instead of
            tensors, so only one full parameter needs to exist in memory at a time.
    """
    tag_dir = _resolve_tag_dir(checkpoint_dir, tag)
    state: OrderedDict = OrderedDict()
    # A pipeline checkpoint has one model-parallel rank per stage, each with its own ZeRO shards; stage-local
    # names are global (layer index prefixes), and a tied weight held by several stages has one value.
    for mp_rank in _model_parallel_ranks(tag_dir):
        for name, value in _one_model_parallel_rank(tag_dir, mp_rank, exclude_frozen_parameters).items():
            state.setdefault(name, value)
    return state if lazy_mode else _materialize(state)


def _one_model_parallel_rank(tag_dir: str, mp_rank: int, exclude_frozen_parameters: bool) -> OrderedDict:
    models = [_parse_model_file(p) for p in _ranked_files(tag_dir, _MODEL_FILE, "model-states", mp_rank)]
    shards = _parse_optim_files(_ranked_files(tag_dir, _OPTIM_FILE, "optimizer-states", mp_rank))
    logger.info(f"zero_to_fp32: '{tag_dir}' mp_rank {mp_rank}: ZeRO stage {shards.stage}, {shards.world_size} rank(s)")
    state: OrderedDict = OrderedDict(models[0].buffers)
    if not exclude_frozen_parameters:
        state.update(_frozen_params(models, shards.stage))
    if shards.stage <= 2:
        state.update(_stage12_params(shards, models[0].param_shapes, _expert_layers(tag_dir)))
    else:
        state.update(_stage3_params(shards, models[0].param_shapes))
    _add_shared(state, models[0].shared_params)
    return state


def _materialize(state: OrderedDict) -> OrderedDict:
    """Build every lazy value once; tied names keep sharing one tensor."""
    built: dict[int, torch.Tensor] = {}
    out: OrderedDict = OrderedDict()
    for name, value in state.items():
        if isinstance(value, GatheredTensor):
            if id(value) not in built:
                built[id(value)] = value.contiguous()
            value = built[id(value)]
        out[name] = value
    return out


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str, tag: str | None = None) -> Any:
    """Move ``model`` to CPU and load the checkpoint's fp32 weights into it (non-strict); returns ``model``.

    The model is then fp32 and off its accelerator; re-wrapping it for training needs a new engine.
    """
    logger.info(f"zero_to_fp32: loading fp32 weights from '{checkpoint_dir}' into {type(model).__name__}")
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


# --- writing --------------------------------------------------------------------------------------
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string such as ``"5GB"`` (10^9) or ``"500MiB"`` (2^20)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
    if not m or m.group(2) not in _SIZE_UNITS:
        raise ValueError(f"max_shard_size={size!r} is not a size; use bytes or e.g. '5GB', '500MB', '2GiB'")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])


def _nbytes(value: Any) -> int:
    return value.numel() * torch.empty((), dtype=value.dtype).element_size()


def plan_shards(state: dict, max_bytes: int) -> list[list[str]]:
    """Split names into consecutive shards of at most ``max_bytes`` (a larger tensor gets its own shard)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, value in state.items():
        size = _nbytes(value)
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _shard_names(count: int, safe: bool) -> tuple[list[str], str]:
    stem, ext = ("model", "safetensors") if safe else ("pytorch_model", "bin")
    if count == 1:
        return [f"{stem}.{ext}"], ""
    names = [f"{stem}-{i + 1:05d}-of-{count:05d}.{ext}" for i in range(count)]
    index = "model.safetensors.index.json" if safe else "pytorch_model.bin.index.json"
    return names, index


def _save_shard(tensors: dict, path: str, safe: bool) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    if safe:
        from safetensors.torch import save_file

        # safetensors refuses tensors that share memory (tied weights): give each name its own copy.
        save_file({k: v.contiguous().clone() for k, v in tensors.items()}, tmp, metadata={"format": "pt"})
    else:
        torch.save(tensors, tmp)
    os.replace(tmp, path)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str,
    output_dir: str,
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write the consolidated fp32 weights of a ZeRO checkpoint into ``output_dir``.

    Produces ``pytorch_model.bin`` (or ``model.safetensors`` with ``safe_serialization``); above
    ``max_shard_size`` the weights are split into numbered shards plus an ``*.index.json`` whose
    ``weight_map`` maps each name to its shard, as Hugging Face ``from_pretrained`` expects.
    """
    if safe_serialization:
        try:
            importlib.import_module("safetensors.torch")
        except ImportError as err:
            raise ImportError(
                "safe_serialization=True needs the 'safetensors' package: pip install safetensors"
            ) from err
    state = get_fp32_state_dict_from_zero_checkpoint(
        checkpoint_dir, tag, exclude_frozen_parameters=exclude_frozen_parameters, lazy_mode=True
    )
    groups = plan_shards(state, parse_size(max_shard_size))
    names, index_name = _shard_names(len(groups), safe_serialization)
    os.makedirs(output_dir, exist_ok=True)
    weight_map: dict[str, str] = {}
    for file_name, keys in zip(names, groups, strict=True):
        # One shard at a time is materialized, so peak memory is about one shard.
        tensors = _materialize(OrderedDict((k, state[k]) for k in keys))
        _save_shard(tensors, os.path.join(output_dir, file_name), safe_serialization)
        weight_map.update({k: file_name for k in keys})
        del tensors
    if index_name:
        index = {"metadata": {"total_size": sum(_nbytes(v) for v in state.values())}, "weight_map": weight_map}
        with open(os.path.join(output_dir, index_name), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    logger.info(f"zero_to_fp32: wrote {len(names)} file(s) to '{output_dir}'")


def main(argv: list[str] | None = None) -> None:
    """Command line: ``zero_to_fp32.py checkpoint_dir output_dir [options]``."""
    parser = argparse.ArgumentParser(description="Consolidate a DeepSpeed ZeRO checkpoint into fp32 weights")
    parser.add_argument("checkpoint_dir", type=str, help="folder holding 'latest' and the tag folders")
    parser.add_argument("output_dir", type=str, help="folder to write pytorch_model.bin / model.safetensors into")
    parser.add_argument("--max_shard_size", type=str, default="5GB", help="largest shard, e.g. 5GB or 500MB")
    parser.add_argument(
        "--safe_serialization", default=False, action="store_true", help="write safetensors instead of torch pickles"
    )
    parser.add_argument("-t", "--tag", type=str, default=None, help="tag folder to read (default: from 'latest')")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="verbose logging")
    args = parser.parse_args(argv)
    if args.debug:
        logger.setLevel("DEBUG")
    convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization,
        tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters,
    )


if __name__ == "__main__":
    main()
