"""Conversion of a ZeRO checkpoint into upstream DeepSpeed's universal checkpoint layout.

[Note: universal layout]
A universal checkpoint stores every parameter whole, independent of how many data-parallel ranks wrote it
and of the ZeRO stage, so training can resume at another data-parallel size or stage::

    <output_folder>/zero/<param name>/fp32.pt        # the fp32 master values
    <output_folder>/zero/<param name>/<state>.pt     # one file per optimizer moment (exp_avg, exp_avg_sq, ...)
    <output_folder>/zero/<param name>/step.pt        # ZeRO-1/2 sources: the optimizer's step count
    <output_folder>/zero/optimizer_state.pt          # loss scaler, clip value, param_groups, ...
    <output_folder>/<the source's model-states files>
    <parent of output_folder>/latest_universal       # text: the output folder's name

As upstream writes it: from a ZeRO-1/2 source each value file holds ``{"param": <tensor of the parameter's
shape>, "cat_dim": 0}``; from a ZeRO-3 source it holds the bare flattened tensor, and the step count lives in
``optimizer_state.pt`` (``optimizer_state_dict.state[0].step``). The loader (``universal_load.py``) reads both.
Here ``optimizer_state.pt`` leaves out the sharded tensors (upstream's ZeRO-3 copy keeps rank 0's flat groups,
which no loader reads).

How the shards are read: every optimizer file is memory-mapped (``torch.load(mmap=True, weights_only=True)``)
and each parameter is cut out of the ranks' flat partitions on its own, so the converter never holds more than
one parameter's states in memory; no temporary fragment files are written. The output is built in a staging
folder next to ``output_folder`` and moved into place only when complete, so a failed conversion leaves the
previous output (if any) untouched. Tensor- and pipeline-parallel, MoE-expert and elastic-format checkpoints
are refused with an error naming what is unsupported.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed._core.checkpoint import files as io
from deepspeed._core.checkpoint.files import LoadTrust
from deepspeed._core.config.zero import ZeroStageEnum
from deepspeed._core.optim.stage12_state import fragment_address
from deepspeed._foundation.logging import logger

# Classes that ZeRO optimizer files pickle (ours and upstream's), for readers that do not import the engine.
io.register_safe_globals([ZeroStageEnum, fragment_address])

UNIVERSAL_LATEST = "latest_universal"
ZERO_FOLDER = "zero"
OPTIMIZER_STATE_FILE = "optimizer_state.pt"
PARAM = "param"
CAT_DIM = "cat_dim"
FP32 = "fp32"
STEP = "step"
PARAM_GROUPS = "param_groups"
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
SINGLE_PARTITION = "single_partition_of_fp32_groups"
PARAM_ALIGNMENT_PADDINGS = "param_alignment_paddings"
BASE_STATE = "base_optimizer_state"
FP32_FLAT_GROUPS = "fp32_flat_groups"
UNIVERSAL_INFO = "universal_checkpoint_info"
UNIVERSAL_VERSION = 0.4

_OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
_EXPERT_RE = re.compile(r"^(expp_rank_\d+_mp_rank_\d+_optim_states|layer_\d+_expert_\d+_mp_rank_\d+_model_states)\.pt$")
_PIPE_LAYER_RE = re.compile(r"^layer_\d+(-model_\d+)?-model_states\.pt$")


class UnsupportedCheckpointError(io.CheckpointError, ValueError):
    """The checkpoint's layout cannot be converted or loaded here; the message names what is unsupported."""


@dataclass(frozen=True)
class ConvertOptions:
    """Converter switches, named after upstream's command-line flags."""

    keep_temp_folder: bool = False  # keep the staging folder when the conversion fails
    strict: bool = True  # the shards must cover the parameters exactly (no unexplained trailing elements)
    inject_missing_state: bool = False  # accepted; the model states always get universal_checkpoint_info
    num_workers: int = 4  # threads writing parameter files


@dataclass
class _Source:
    """The input checkpoint, read lazily (optimizer files are memory-mapped)."""

    folder: str
    stage: int
    optim_paths: list[str]
    optim: list[dict]  # each rank's ``optimizer_state_dict``
    model_paths: list[str]
    model: dict  # the first model-states file
    trust: LoadTrust


# --- reading the source -------------------------------------------------------------------------------------
def read_source(folder: str, trust: LoadTrust) -> _Source:
    """Open ``folder`` (a ``<save_dir>/<tag>`` of a ZeRO checkpoint), refusing layouts that cannot be converted."""
    if not os.path.isdir(folder):
        raise io.CheckpointFileMissingError(f"checkpoint folder '{folder}' does not exist", folder, None)
    names = sorted(os.listdir(folder))
    _refuse_unsupported_files(folder, names)
    optim_paths = _optim_paths(folder, names)
    optim = []
    for path in optim_paths:
        shard = io.load_file(path, None, trust, mmap=True)
        io.require_keys(shard, [OPTIMIZER_STATE_DICT], path, None)
        optim.append(shard[OPTIMIZER_STATE_DICT])
    stage = _stage_of(optim[0], optim_paths[0])
    model_paths = _model_paths(folder, stage, len(optim_paths))
    model = io.load_file(model_paths[0], None, trust, mmap=True)
    io.require_keys(model, ["module", "param_shapes"], model_paths[0], None)
    if model["module"] is None:
        raise UnsupportedCheckpointError(
            f"'{model_paths[0]}' keeps its weights in per-layer files (a pipeline-parallel checkpoint): "
            "universal conversion of pipeline-parallel checkpoints is not supported",
            model_paths[0],
            None,
        )
    source = _Source(folder, stage, optim_paths, optim, model_paths, model, trust)
    _check_shards(source)
    return source


def _refuse_unsupported_files(folder: str, names: list[str]) -> None:
    for name in names:
        what = None
        if _EXPERT_RE.match(name):
            what = "MoE expert files"
        elif _PIPE_LAYER_RE.match(name):
            what = "pipeline-parallel layer files"
        else:
            m = _OPTIM_RE.match(name)
            if m and int(m.group(2)) != 0:
                what = "model-parallel (tensor-parallel) ranks other than mp_rank_00"
        if what is not None:
            path = os.path.join(folder, name)
            raise UnsupportedCheckpointError(
                f"'{path}': universal conversion of checkpoints with {what} is not supported "
                "(supported: ZeRO stage 1-3, data parallelism only)",
                path,
                None,
            )


def _optim_paths(folder: str, names: list[str]) -> list[str]:
    """The optimizer files indexed by data-parallel rank; every rank from 0 to the last must be present."""
    by_rank: dict[int, str] = {}
    for name in names:
        m = _OPTIM_RE.match(name)
        if m:
            by_rank.setdefault(int(m.group(1)), os.path.join(folder, name))
    if not by_rank:
        raise UnsupportedCheckpointError(
            f"'{folder}' holds no ZeRO optimizer files (*_optim_states.pt): universal conversion needs a "
            "checkpoint saved with zero_optimization.stage 1, 2 or 3",
            folder,
            None,
        )
    count = max(by_rank) + 1
    for rank in range(count):
        if rank not in by_rank:
            _missing(os.path.join(folder, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    return [by_rank[r] for r in range(count)]


def _missing(path: str) -> None:
    raise io.CheckpointFileMissingError(f"checkpoint file '{path}' does not exist", path, None)


def _stage_of(osd: dict, path: str) -> int:
    if not isinstance(osd, dict):
        raise io.CheckpointCorruptError(f"'{path}': optimizer_state_dict is not a dict", path, None)
    if FP32_FLAT_GROUPS in osd:
        return 3
    if SINGLE_PARTITION in osd:
        return int(osd.get("zero_stage", 1))  # upstream's BF16_Optimizer (stage 1) writes no zero_stage
    raise io.CheckpointCorruptError(
        f"'{path}' holds neither {SINGLE_PARTITION} (ZeRO-1/2) nor {FP32_FLAT_GROUPS} (ZeRO-3)", path, None
    )


def _model_paths(folder: str, stage: int, world: int) -> list[str]:
    if stage <= 2:
        names = ["mp_rank_00_model_states.pt"]
    else:
        names = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
    paths = [os.path.join(folder, n) for n in names]
    for path in paths:
        if not os.path.isfile(path):
            _missing(path)
    return paths


def _check_shards(src: _Source) -> None:
    saved_world = src.model.get("dp_world_size")
    if saved_world is not None and int(saved_world) > len(src.optim):
        _missing(os.path.join(src.folder, f"zero_pp_rank_{len(src.optim)}_mp_rank_00_optim_states.pt"))
    for path, osd in zip(src.optim_paths, src.optim, strict=True):
        if src.stage <= 2:
            io.require_keys(osd, [SINGLE_PARTITION, BASE_STATE], path, None)
            if isinstance(osd[BASE_STATE], list):
                raise UnsupportedCheckpointError(
                    f"'{path}' holds the elastic_checkpoint optimizer format: universal conversion of it is not "
                    "supported (save with zero_optimization.elastic_checkpoint false)",
                    path,
                    None,
                )
            if any(any(group) for group in osd.get(PARAM_ALIGNMENT_PADDINGS) or []):
                raise UnsupportedCheckpointError(
                    f"'{path}': its '{PARAM_ALIGNMENT_PADDINGS}' are not all 0 (saved with "
                    "zero_optimization.parameter_alignment, which pads between parameters): universal conversion "
                    "of that layout is not supported",
                    path,
                    None,
                )
            counts = osd.get("partition_count", len(src.optim))
            counts = counts if isinstance(counts, (list, tuple)) else [counts]
            if any(int(c) != len(src.optim) for c in counts):
                raise UnsupportedCheckpointError(
                    f"'{path}': groups partitioned over {sorted({int(c) for c in counts})} ranks of a "
                    f"{len(src.optim)}-rank run (MoE expert groups) are not supported by universal conversion",
                    path,
                    None,
                )
        else:
            io.require_keys(osd, [FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT], path, None)
            if osd.get("ds_zero_partition_groups"):
                raise UnsupportedCheckpointError(
                    f"'{path}' was written with sub-group partitioning (ds_zero_partition_groups): universal "
                    "conversion of it is not supported",
                    path,
                    None,
                )


# --- cutting parameters out of the shards ----------------------------------------------------------------
def _numel(shape: Any) -> int:
    return math.prod(int(d) for d in shape)


def _concat_range(pieces: list[torch.Tensor], start: int, numel: int) -> torch.Tensor:
    """Elements ``[start, start + numel)`` of the concatenation of the 1-D ``pieces`` (read piece by piece)."""
    out = []
    base = 0
    for piece in pieces:
        lo, hi = max(start, base), min(start + numel, base + piece.numel())
        if lo < hi:
            out.append(piece[lo - base : hi - base])
        base += piece.numel()
    got = sum(t.numel() for t in out)
    if got != numel:
        raise ValueError(f"the shards hold {base} elements, too few for [{start}, {start + numel})")
    return torch.cat(out).float() if out else torch.zeros(0)


def _moment_keys(state: dict) -> list[str]:
    """Optimizer-state entries shaped like the partition (moments); the step count and scalars are not."""
    return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() >= 1)


def _stage12_params(src: _Source, strict: bool) -> Iterator[tuple[str, Any, dict[str, torch.Tensor], Any]]:
    """``(name, shape, {state: flat fp32 values}, step)`` per trainable parameter of a ZeRO-1/2 checkpoint."""
    for g, shapes in enumerate(src.model["param_shapes"]):
        fp32 = [osd[SINGLE_PARTITION][g].reshape(-1) for osd in src.optim]
        lens = [t.numel() for t in fp32]
        states = [osd[BASE_STATE]["state"].get(g, {}) for osd in src.optim]
        streams = {FP32: fp32}
        for key in _moment_keys(states[0]):
            streams[key] = [s[key].reshape(-1)[:n] for s, n in zip(states, lens, strict=True)]
        total = sum(_numel(s) for s in shapes.values())
        if sum(lens) < total or (strict and sum(lens) != total):
            raise io.CheckpointCorruptError(
                f"the optimizer files of '{src.folder}' hold {sum(lens)} elements for group {g}, whose parameters "
                f"(param_shapes in '{src.model_paths[0]}') have {total}",
                src.folder,
                None,
            )
        offset = 0
        for name, shape in shapes.items():
            n = _numel(shape)
            values = {k: _concat_range(v, offset, n).reshape(tuple(shape)) for k, v in streams.items()}
            yield name, shape, values, states[0].get(STEP)
            offset += n


def _stage3_params(src: _Source, strict: bool) -> Iterator[tuple[str, Any, dict[str, torch.Tensor], Any]]:
    """The same for ZeRO-3: every rank holds ``ceil(numel / world)`` elements of each parameter, back to back."""
    world = len(src.optim)
    shapes_per_group = src.model["param_shapes"]
    if len(shapes_per_group) != len(src.optim[0][FP32_FLAT_GROUPS]):
        raise io.CheckpointCorruptError(
            f"'{src.model_paths[0]}' lists {len(shapes_per_group)} parameter groups but '{src.optim_paths[0]}' "
            f"holds {len(src.optim[0][FP32_FLAT_GROUPS])} flat groups",
            src.model_paths[0],
            None,
        )
    for g, shapes in enumerate(shapes_per_group):
        states = [osd[OPTIMIZER_STATE_DICT]["state"].get(g, {}) for osd in src.optim]
        streams = {FP32: [osd[FP32_FLAT_GROUPS][g].reshape(-1) for osd in src.optim]}
        for key in _moment_keys(states[0]):
            streams[key] = [s[key].reshape(-1) for s in states]
        offset = 0
        for name, shape in shapes.items():
            n = _numel(shape)
            part = math.ceil(n / world)
            values = {k: _stage3_full(v, offset, part, n) for k, v in streams.items()}
            yield name, shape, values, None
            offset += part
        if strict and offset != streams[FP32][0].numel():
            raise io.CheckpointCorruptError(
                f"'{src.optim_paths[0]}' holds {streams[FP32][0].numel()} elements per rank for group {g}, "
                f"but its parameters account for {offset}",
                src.optim_paths[0],
                None,
            )


def _stage3_full(per_rank: list[torch.Tensor], offset: int, part: int, numel: int) -> torch.Tensor:
    pieces = []
    for rank, flat in enumerate(per_rank):
        valid = max(0, min(part, numel - rank * part))
        if offset + valid > flat.numel():
            raise ValueError(f"a rank's flat group holds {flat.numel()} elements, too few for offset {offset + valid}")
        pieces.append(flat[offset : offset + valid])
    return torch.cat(pieces).float()


# --- writing --------------------------------------------------------------------------------------------------
class _Writer:
    """Saves files under the staging folder on a few threads, keeping a bounded number of writes in flight."""

    def __init__(self, root: str, workers: int) -> None:
        self.root = root
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers))
        self.pending: collections.deque = collections.deque()
        self.limit = 2 * max(1, workers)

    def save(self, obj: Any, *parts: str) -> None:
        path = os.path.join(self.root, *parts)
        self.pending.append(self.pool.submit(_save_file, obj, path))
        while len(self.pending) > self.limit:
            self.pending.popleft().result()

    def close(self) -> None:
        try:
            while self.pending:
                self.pending.popleft().result()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _save_file(obj: Any, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(obj, path)


def _write_params(src: _Source, writer: _Writer, strict: bool) -> set[str]:
    """Every trainable parameter's files; returns the names written."""
    params = _stage12_params(src, strict) if src.stage <= 2 else _stage3_params(src, strict)
    written = set()
    for name, _shape, values, step in params:
        for key, value in values.items():
            obj = {PARAM: value, CAT_DIM: 0} if src.stage <= 2 else value.reshape(-1)
            writer.save(obj, ZERO_FOLDER, name, f"{key}.pt")
        if step is not None:
            writer.save(step, ZERO_FOLDER, name, f"{STEP}.pt")
        written.add(name)
    return written


def _write_frozen(src: _Source, writer: _Writer, written: set[str]) -> None:
    """Parameters the optimizer does not hold (frozen ones) get an ``fp32.pt`` from the model states."""
    aliases = set((src.model.get("shared_params") or {}).keys())
    if src.stage <= 2:
        buffers = set(src.model.get("buffer_names") or [])
        for name, value in src.model["module"].items():
            if name not in written and name not in buffers and name not in aliases and torch.is_tensor(value):
                writer.save({PARAM: value.float()}, ZERO_FOLDER, name, f"{FP32}.pt")
        return
    shapes = src.model.get("frozen_param_shapes") or {}
    if not shapes:
        return
    fragments = []
    for path in src.model_paths:
        state = src.model if path == src.model_paths[0] else io.load_file(path, None, src.trust, mmap=True)
        io.require_keys(state, ["frozen_param_fragments"], path, None)
        fragments.append(state["frozen_param_fragments"])
    for name, shape in shapes.items():
        n = _numel(shape)
        full = _stage3_full([f[name].reshape(-1) for f in fragments], 0, math.ceil(n / len(fragments)), n)
        writer.save(full, ZERO_FOLDER, name, f"{FP32}.pt")


def _optimizer_state(src: _Source) -> dict:
    """``zero/optimizer_state.pt``: rank 0's optimizer state without the sharded tensors, plus ``param_groups``."""
    osd = src.optim[0]
    if src.stage <= 2:
        out = {k: v for k, v in osd.items() if k not in (BASE_STATE, SINGLE_PARTITION, "param_slice_mappings")}
        out[PARAM_GROUPS] = osd[BASE_STATE][PARAM_GROUPS]
        return out
    inner = osd[OPTIMIZER_STATE_DICT]
    scalars = {g: {k: v for k, v in s.items() if k not in _moment_keys(s)} for g, s in inner["state"].items()}
    out = {k: v for k, v in osd.items() if k not in (FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT)}
    out[OPTIMIZER_STATE_DICT] = {"state": scalars, PARAM_GROUPS: inner[PARAM_GROUPS]}
    out[PARAM_GROUPS] = inner[PARAM_GROUPS]
    return out


def _write_model_states(src: _Source, staging: str) -> None:
    """Copy the model-states files, adding ``universal_checkpoint_info`` where the source has none."""
    for path in src.model_paths:
        state = src.model if path == src.model_paths[0] else io.load_file(path, None, src.trust, mmap=True)
        target = os.path.join(staging, os.path.basename(path))
        if UNIVERSAL_INFO in state:
            shutil.copyfile(path, target)
            continue
        # Upstream's converter asks for --inject_missing_state here; the entry only guides tensor-parallel
        # merges, which never happen in a data-parallel checkpoint, so it is always added.
        torch.save({**state, UNIVERSAL_INFO: {"universal_checkpoint_version": UNIVERSAL_VERSION}}, target)


# --- entry point ----------------------------------------------------------------------------------------------
def convert_to_universal(
    input_folder: str, output_folder: str, options: ConvertOptions = ConvertOptions(), log: Callable | None = None
) -> str:
    """Write the universal form of the checkpoint ``input_folder`` (``<save_dir>/<tag>``) to ``output_folder``.

    Also points ``<parent of output_folder>/latest_universal`` at it. Returns ``output_folder``.

    Raises:
        CheckpointError: a source file is missing, damaged or refused by safe loading (the message names it),
            or the layout is unsupported (:class:`UnsupportedCheckpointError`).
    """
    log = log or logger.info
    output_folder = os.path.abspath(os.fspath(output_folder))
    src = read_source(os.fspath(input_folder), LoadTrust.from_env())
    log(f"converting the ZeRO-{src.stage} checkpoint '{src.folder}' ({len(src.optim)} data-parallel ranks) ...")
    staging = f"{output_folder}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        writer = _Writer(staging, options.num_workers)
        try:
            written = _write_params(src, writer, options.strict)
            _write_frozen(src, writer, written)
            writer.save(_optimizer_state(src), ZERO_FOLDER, OPTIMIZER_STATE_FILE)
        finally:
            writer.close()
        _write_model_states(src, staging)
    except BaseException:
        if not options.keep_temp_folder:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    _move_into_place(staging, output_folder)
    parent, name = os.path.split(output_folder)
    io.atomic_write_text(name, os.path.join(parent, UNIVERSAL_LATEST))
    log(f"wrote {len(written)} parameters to '{output_folder}'")
    return output_folder


def _move_into_place(staging: str, output_folder: str) -> None:
    """Swap the complete staging folder in; a previous output is removed only after the swap."""
    if not os.path.exists(output_folder):
        os.replace(staging, output_folder)
        return
    old = f"{output_folder}.old-{os.getpid()}"
    os.replace(output_folder, old)
    os.replace(staging, output_folder)
    shutil.rmtree(old, ignore_errors=True)
