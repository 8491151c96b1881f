"""Loading a universal checkpoint ([Note: universal layout] in ``universal.py``) at any data-parallel size and stage.

[Note: universal load]
With ``checkpoint.load_universal`` the engine's ``load_checkpoint(dir, tag=None)`` reads the tag from
``<dir>/latest_universal`` (missing: ``ValueError``, as upstream). Each rank asks its ZeRO optimizer which
elements of which parameters its flat masters hold (``universal_targets()``: a ZeRO-1/2 partition of a flat
group, or a ZeRO-3 shard of each parameter), memory-maps each parameter's ``fp32.pt`` and moment files and
copies just those elements. Counters, the LR scheduler and the client state come from the model-states file the
folder carries; buffers come from its ``module`` entry and parameters the optimizer does not hold (frozen ones)
from their ``fp32.pt``. Under ZeRO-3 a frozen parameter is gathered one at a time, given the file's values on
every rank and partitioned again (a collective per frozen parameter, in the module's order on every rank).

Every file is read, and every rank has agreed that its reads succeeded, before anything is changed: a missing,
truncated or refused file raises on every rank (naming the file) and leaves the engine as it was.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from deepspeed._core.checkpoint import files as io
from deepspeed._core.checkpoint import save_load as ckpt
from deepspeed._core.checkpoint.files import LoadTrust
from deepspeed._core.checkpoint.universal import (
    FP32,
    OPTIMIZER_STATE_DICT,
    OPTIMIZER_STATE_FILE,
    PARAM,
    PARAM_GROUPS,
    STEP,
    UNIVERSAL_LATEST,
    ZERO_FOLDER,
    UnsupportedCheckpointError,
)
from deepspeed._core.comm import dist
from deepspeed._core.optim.universal_state import UniversalGroupState, UniversalTarget
from deepspeed._core.params.gathered import GatheredContext, ModifierRank, collect_states


class UniversalFolder:
    """Reads the ``zero/`` folder of a universal checkpoint for one rank (errors name the file and rank)."""

    def __init__(self, root: str, rank: int, trust: LoadTrust) -> None:
        self.root = root
        self.rank = rank
        self.trust = trust

    def path(self, name: str, key: str) -> str:
        """The file of state ``key`` of parameter ``name``."""
        return os.path.join(self.root, name, f"{key}.pt")

    def optimizer_state(self) -> dict:
        """``optimizer_state.pt``: loss scaler, clip value, ``param_groups``."""
        path = os.path.join(self.root, OPTIMIZER_STATE_FILE)
        state = io.load_file(path, self.rank, self.trust)
        io.require_keys(state, [PARAM_GROUPS], path, self.rank)
        return state

    def values(self, name: str, key: str, numel: int) -> torch.Tensor:
        """The flattened values of ``key`` for parameter ``name``, which must hold ``numel`` elements."""
        path = self.path(name, key)
        obj = io.load_file(path, self.rank, self.trust, mmap=True)
        if isinstance(obj, dict):
            io.require_keys(obj, [PARAM], path, self.rank)
            obj = obj[PARAM]
        if not torch.is_tensor(obj):
            raise io.CheckpointCorruptError(
                f"checkpoint file {io.where(path, self.rank)} holds a {type(obj).__name__}, expected a tensor or "
                f"a dict with '{PARAM}'",
                path,
                self.rank,
            )
        if obj.numel() != numel:
            raise io.CheckpointCorruptError(
                f"checkpoint file {io.where(path, self.rank)} holds {obj.numel()} values but parameter '{name}' "
                f"has {numel}: the checkpoint belongs to a different model",
                path,
                self.rank,
            )
        return obj.reshape(-1)

    def moment_keys(self, name: str) -> list[str]:
        """The optimizer states saved for ``name`` (every ``<key>.pt`` but ``fp32`` and ``step``)."""
        folder = os.path.join(self.root, name)
        if not os.path.isdir(folder):
            return []
        return sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".pt") and f[:-3] not in (FP32, STEP))

    def step(self, name: str) -> Any:
        """``step.pt`` of ``name`` (ZeRO-1/2 sources), or ``None``."""
        path = self.path(name, STEP)
        return io.load_file(path, self.rank, self.trust) if os.path.isfile(path) else None


@dataclass
class _Reads:
    """Everything one rank read, before anything is applied."""

    state: dict
    global_state: dict
    groups: list[UniversalGroupState]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    frozen: dict[str, torch.Tensor] = field(default_factory=dict)


def read_universal_latest(load_dir: str) -> str:
    """The tag in ``<load_dir>/latest_universal``; ``ValueError`` when the file is missing (upstream's rule)."""
    path = os.path.join(load_dir, UNIVERSAL_LATEST)
    if not os.path.isfile(path):
        raise ValueError(
            f"checkpoint.load_universal is set but '{path}' does not exist: pass tag=<folder name> or run "
            "python -m deepspeed.checkpoint.ds_to_universal, which writes it"
        )
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


def check_supported(subject: ckpt.CheckpointSubject) -> None:
    """Raise (on every rank alike, before any read) when this engine cannot take a universal checkpoint."""
    what = None
    if not callable(getattr(subject.optimizer, "universal_targets", None)):
        what = "an engine without a ZeRO optimizer (zero_optimization.stage 1, 2 or 3 is needed)"
    elif subject.moe is not None:
        what = "a model with MoE layers"
    elif subject.module_files is not None:
        what = "a pipeline-parallel module"
    elif subject.topology.mp_world_size > 1:
        what = "model (tensor) parallelism"
    if what is not None:
        raise UnsupportedCheckpointError(
            f"checkpoint.load_universal: loading a universal checkpoint into {what} is not supported", "", None
        )


def load_universal_checkpoint(subject: ckpt.CheckpointSubject, request: ckpt.LoadRequest) -> ckpt.LoadOutcome:
    """Restore the engine from the universal checkpoint ``<load_dir>/<tag>`` (see [Note: universal load])."""
    check_supported(subject)
    tag = request.tag if request.tag is not None else read_universal_latest(request.load_dir)
    ckpt_dir = os.path.join(request.load_dir, str(tag))
    opt = subject.optimizer
    ckpt._optional_call(opt, "checkpoint_event_prologue")
    try:
        reads = _read_all(subject, request, ckpt_dir)
        _apply(subject, request, reads)
    finally:
        ckpt._optional_call(opt, "checkpoint_event_epilogue")
    return ckpt.LoadOutcome(ckpt_dir, reads.state, ckpt.client_state_of(reads.state, request))


# --- reading ------------------------------------------------------------------------------------------------
def _read_all(subject: ckpt.CheckpointSubject, request: ckpt.LoadRequest, ckpt_dir: str) -> _Reads:
    rank = dist.get_rank()
    reads: _Reads | None = None
    error: BaseException | None = None
    try:
        if not os.path.isdir(ckpt_dir):
            msg = f"universal checkpoint folder '{ckpt_dir}' does not exist"
            raise io.CheckpointFileMissingError(msg, ckpt_dir, rank)
        state = _model_states(subject, request, ckpt_dir, rank)
        folder = UniversalFolder(os.path.join(ckpt_dir, ZERO_FOLDER), rank, request.trust)
        global_state = folder.optimizer_state()
        wants_state = request.optimizer_states and not request.module_only
        names = {id(p): n for n, p in subject.module.named_parameters()}
        targets = subject.optimizer.universal_targets()
        groups = [_read_group(folder, t, names, wants_state) for t in targets]
        _fill_steps_and_settings(groups, global_state, wants_state)
        reads = _Reads(state, global_state, groups)
        reads.buffers = _saved_buffers(subject.module, state["module"], request, ckpt_dir)
        reads.frozen = _read_frozen(subject, folder, targets, request)
    except Exception as err:  # noqa: BLE001 - re-raised after the agreement below
        error = err
    # Nothing has been changed yet; no rank may start applying while another failed to read.
    ckpt._agree_or_raise(error, f"reading universal checkpoint '{ckpt_dir}'")
    assert reads is not None
    return reads


def _model_states(subject: ckpt.CheckpointSubject, request: ckpt.LoadRequest, ckpt_dir: str, rank: int) -> dict:
    """The model-states file the folder carries: stages 0-2 write ``mp_rank_00_…``, stage 3 ``zero_pp_rank_0_…``."""
    topo = subject.topology
    names = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"]
    if topo.model_file_per_dp_rank:
        names.reverse()
    paths = [os.path.join(ckpt_dir, n) for n in names]
    path = next((p for p in paths if os.path.isfile(p)), paths[0])
    state = io.load_file(path, rank, request.trust)
    io.require_keys(state, ["module"], path, rank)
    return state


def _full_numel(param: torch.nn.Parameter) -> int:
    return math.prod(getattr(param, "ds_shape", param.shape))


def _read_group(
    folder: UniversalFolder, target: UniversalTarget, names: dict[int, str], wants_state: bool
) -> UniversalGroupState:
    """This rank's flat fp32 values and moments of one group, cut from each parameter's files."""
    fp32 = torch.zeros(target.numel, dtype=torch.float32)
    group = UniversalGroupState(fp32)
    keys: list[str] | None = None
    for piece in target.slices:
        name = names[id(piece.param)]
        numel = _full_numel(piece.param)
        dst, src = piece.partition_range.as_slice(), piece.param_range.as_slice()
        fp32[dst] = folder.values(name, FP32, numel)[src]
        if not wants_state:
            continue
        found = folder.moment_keys(name)
        if keys is None:
            keys = found
            if not keys:
                raise io.CheckpointFileMissingError(
                    f"the universal checkpoint holds no optimizer moments for '{name}' (no files besides fp32.pt "
                    f"in '{os.path.join(folder.root, name)}'); pass load_optimizer_states=False to load the weights "
                    "only",
                    folder.path(name, FP32),
                    folder.rank,
                )
            group.moments = {k: torch.zeros(target.numel, dtype=torch.float32) for k in keys}
            group.step = folder.step(name)
        for key in keys:
            group.moments[key][dst] = folder.values(name, key, numel)[src]
    return group


def _fill_steps_and_settings(groups: list[UniversalGroupState], global_state: dict, wants_state: bool) -> None:
    """Step counts missing from ``step.pt`` (ZeRO-3 sources) and each group's saved hyperparameters."""
    saved_groups = global_state[PARAM_GROUPS]
    inner_state = (global_state.get(OPTIMIZER_STATE_DICT) or {}).get("state") or {}
    first: dict = next(iter(inner_state.values()), {}) if inner_state else {}
    fallback = first.get(STEP) if inner_state else None
    for index, group in enumerate(groups):
        if saved_groups:
            group.hyperparams = dict(saved_groups[index] if index < len(saved_groups) else saved_groups[0])
        if wants_state and group.moments and group.step is None:
            group.step = fallback


def _saved_buffers(module: torch.nn.Module, saved: dict, request: ckpt.LoadRequest, ckpt_dir: str) -> dict:
    out = {}
    for name in ckpt.persistent_buffer_names(module):
        if name in saved:
            out[name] = saved[name]
        elif request.module_strict:
            raise io.CheckpointCorruptError(
                f"the model states in '{ckpt_dir}' lack the buffer '{name}' (pass load_module_strict=False to keep "
                "the current value)",
                ckpt_dir,
                dist.get_rank(),
            )
    return out


def _read_frozen(
    subject: ckpt.CheckpointSubject, folder: UniversalFolder, targets: list[UniversalTarget], request: ckpt.LoadRequest
) -> dict:
    """Full fp32 values of the parameters no optimizer group holds (frozen ones)."""
    held = {id(piece.param) for t in targets for piece in t.slices}
    held |= {id(p) for group in subject.optimizer.checkpoint_param_groups() for p in group}
    out = {}
    for name, param in subject.module.named_parameters():
        if id(param) in held:
            continue
        if not os.path.isfile(folder.path(name, FP32)) and not request.module_strict:
            continue
        out[name] = folder.values(name, FP32, _full_numel(param))
    return out


# --- applying -----------------------------------------------------------------------------------------------
def _apply(subject: ckpt.CheckpointSubject, request: ckpt.LoadRequest, reads: _Reads) -> None:
    module = subject.module
    with torch.no_grad():
        for name, value in reads.buffers.items():
            module.get_buffer(name).copy_(value)
        params = dict(module.named_parameters())
        for name, value in reads.frozen.items():
            _set_full_value(params[name], value)
    subject.optimizer.load_universal_state(reads.groups, reads.global_state)
    ckpt._apply_scheduler(subject, request, reads.state)


def _set_full_value(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Give ``param`` the full ``value``; a ZeRO-3 partitioned parameter is gathered, written and partitioned again.

    Every rank read the same file, so rank 0's copy (broadcast on leaving the context) equals everyone's.
    """
    states = collect_states(param)
    if not states:
        param.copy_(value.view(param.shape))
        return
    with GatheredContext(states, ModifierRank(0)):
        param.data.copy_(value.view(param.data.shape))
