"""Checkpoint save/load orchestration in upstream DeepSpeed's on-disk layout.

Who writes what (``<save_dir>/<tag>/``, tag ``global_step<N>`` by default):

* ``mp_rank_XX_model_states.pt``: stages 0-2, written by data-parallel rank 0 (module, counters,
  scheduler, config; under stage 0 also the whole optimizer state in its ``optimizer`` entry);
* ``zero_pp_rank_<dp>_mp_rank_XX_model_states.pt``: stage 3, one per data-parallel rank;
* ``[bf16_]zero_pp_rank_<dp>_mp_rank_XX_optim_states.pt``: stages 1-3, one per data-parallel rank,
  ``{"optimizer_state_dict": <the wrapped optimizer's state_dict()>, "ds_config", "ds_version"}``;
* ``<save_dir>/latest`` (the tag) and, for ZeRO, ``<save_dir>/zero_to_fp32.py``: global rank 0, last.

Files are committed atomically (see [Note: atomic checkpoint files] in ``files.py``), and the
ranks agree that every file is committed before ``latest`` moves, so a crash mid-save leaves the
previous tag loadable. Reads are pickle-safe ([Note: safe checkpoint loading]).

[Note: ZeRO optimizer checkpoint interface]
A ZeRO optimizer plugs in by implementing :class:`ShardedCheckpointOptimizer`; nothing here branches
on its class. Stage 0's wrapped optimizer needs only ``state_dict()`` / ``load_state_dict(dict)``.
Which files exist follows from the stage alone (:class:`CheckpointTopology`).
"""

from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from deepspeed._core.checkpoint import files as io
from deepspeed._core.checkpoint.files import LoadTrust
from deepspeed._core.comm import dist
from deepspeed._core.comm.collectives import sum_over
from deepspeed._core.moe import checkpoint as moe_ckpt
from deepspeed._core.params.param import zero_state
from deepspeed._foundation.logging import logger
from deepspeed.accelerator import get_accelerator

LATEST_FILE = "latest"
ZERO_TO_FP32_SCRIPT = "zero_to_fp32.py"
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
CHECKPOINT_PARALLEL_DIMS = "checkpoint_parallel_dimensions"
# Model-states entries the engine consumes on load; the rest is handed back as client state.
_ENGINE_KEYS = (
    "module",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "dp_world_size",
    "mp_world_size",
    "data_sampler",
    "random_ltd",
)


@runtime_checkable
class ShardedCheckpointOptimizer(Protocol):
    """What a ZeRO (stage 1-3) wrapped optimizer implements to be checkpointed.

    Optional extras, called when present: ``checkpoint_event_prologue()`` / ``checkpoint_event_epilogue()``
    around save and load (ZeRO-3: make parameters partitioned and quiescent),
    ``checkpoint_check_shards(state_dict_list)`` to refuse shards it cannot read while nothing has changed yet, and
    ``checkpoint_shard_ranks(saved_dp_world_size) -> list[int]`` to read fewer than all shards (the
    list handed to ``load_state_dict`` then holds ``None`` for the shards not read).
    """

    def checkpoint_param_groups(self) -> list[list[torch.nn.Parameter]]:
        """Trainable model parameters per group, in the order of the optimizer's flat fp32 groups."""

    def state_dict(self) -> dict:
        """This rank's shard, with upstream's keys (e.g. ``single_partition_of_fp32_groups``)."""

    def load_state_dict(
        self, state_dict_list: list, load_optimizer_states: bool = True, load_from_fp32_weights: bool = True
    ) -> None:
        """Restore from every saved rank's shard (index = saved data-parallel rank)."""

    def refresh_fp32_params(self) -> None:
        """Rebuild fp32 masters from the (just loaded) low-precision model weights."""


@runtime_checkable
class ModuleFiles(Protocol):
    """A module whose weights are saved in files of their own instead of the model-states ``module`` entry.

    A pipeline module writes one file per layer (``deepspeed._core.pipe.checkpoint.PipelineModuleFiles``);
    the model-states file then stores ``module: None``, as upstream's pipeline engine does.
    """

    @property
    def pipe_degree(self) -> int:
        """Number of pipeline stages the module's files are spread over."""

    def save(self, ckpt_dir: str, exclude_frozen_parameters: bool) -> None:
        """Write the module's files into the tag folder (called on the ranks that write model files)."""

    def load(self, ckpt_dir: str, strict: bool, trust: LoadTrust, saved_param_names: set[str] | None) -> None:
        """Read them back (called on every rank; may be collective). ``saved_param_names``: the trainable
        parameters the optimizer shards about to be loaded were saved for (``None``: no shards are loaded)."""


@dataclasses.dataclass(frozen=True)
class CheckpointTopology:
    """Where this rank sits and which files it owns; built once per save or load."""

    zero_stage: int
    bf16: bool
    global_rank: int
    local_rank: int
    dp_rank: int
    dp_world_size: int
    mp_rank: int = 0
    mp_world_size: int = 1
    node_local_storage: bool = False

    @property
    def shards_optimizer(self) -> bool:
        """Optimizer state lives in per-rank ``*_optim_states.pt`` files (stages 1-3)."""
        return self.zero_stage > 0

    @property
    def model_file_per_dp_rank(self) -> bool:
        """Every data-parallel rank writes its own model-states file (stage 3)."""
        return self.zero_stage >= 3

    @property
    def saves_frozen_params(self) -> bool:
        """Frozen parameter shapes/fragments are recorded (stages 2-3, as upstream)."""
        return self.zero_stage >= 2

    @property
    def writes_model_file(self) -> bool:
        """This rank writes a model-states file."""
        if self.model_file_per_dp_rank or self.dp_rank == 0:
            return True
        return self.node_local_storage and self.local_rank == 0

    @property
    def is_coordinator(self) -> bool:
        """This rank writes ``latest`` and ``zero_to_fp32.py`` (one per node with node-local storage)."""
        return self.global_rank == 0 or (self.node_local_storage and self.local_rank == 0)


@dataclasses.dataclass(frozen=True)
class CheckpointSubject:
    """The engine parts a save or load touches."""

    module: torch.nn.Module
    optimizer: Any
    lr_scheduler: Any
    topology: CheckpointTopology
    ds_config: Any
    ds_version: str
    dp_group: Any = None
    zero_to_fp32_source: str | None = None
    load_from_fp32_weights: bool = True
    moe: moe_ckpt.MoECheckpointLayout | None = None  # models with MoE layers: experts in files of their own
    module_files: ModuleFiles | None = None


@dataclasses.dataclass(frozen=True)
class SaveRequest:
    """Arguments of one ``save_checkpoint`` call, validated by the façade."""

    save_dir: str
    tag: str
    save_latest: bool = True
    exclude_frozen_parameters: bool = False
    tag_validation: str = "WARN"


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """Arguments of one ``load_checkpoint`` call."""

    load_dir: str
    tag: str | None
    module_strict: bool = True
    optimizer_states: bool = True
    lr_scheduler_states: bool = True
    module_only: bool = False
    custom_load_fn: Callable[..., Any] | None = None
    trust: LoadTrust = LoadTrust.SAFE


@dataclasses.dataclass(frozen=True)
class LoadOutcome:
    """What ``load_checkpoint`` hands back to the façade."""

    path: str
    state: dict
    client_state: dict


# --- naming -------------------------------------------------------------------------------------
def default_tag(global_steps: int) -> str:
    """Upstream's default tag; HF Trainer globs for ``global_step*`` folders, so the form is load-bearing."""
    return f"global_step{global_steps}"


def model_file_name(topo: CheckpointTopology, dp_rank: int | None = None) -> str:
    """Model-states file name for this rank (or for ``dp_rank`` under stage 3)."""
    mp = f"mp_rank_{topo.mp_rank:02d}"
    if topo.model_file_per_dp_rank:
        rank = topo.dp_rank if dp_rank is None else dp_rank
        return f"zero_pp_rank_{rank}_{mp}_model_states.pt"
    return f"{mp}_model_states.pt"


def optim_file_name(topo: CheckpointTopology, dp_rank: int) -> str:
    """ZeRO optimizer-states file name of ``dp_rank`` (``bf16_`` prefix in bf16 runs)."""
    prefix = "bf16_" if topo.bf16 else ""
    return f"{prefix}zero_pp_rank_{dp_rank}_mp_rank_{topo.mp_rank:02d}_optim_states.pt"


def _optim_file_candidates(topo: CheckpointTopology, dp_rank: int) -> list[str]:
    # Upstream readers accept either precision prefix and an early spelling without the underscore.
    preferred = optim_file_name(topo, dp_rank)
    other = preferred[len("bf16_") :] if topo.bf16 else "bf16_" + preferred
    names = [preferred, other]
    return names + [n.replace("_optim_states.pt", "optim_states.pt") for n in names]


def read_latest(load_dir: str) -> str | None:
    """The tag recorded in ``<load_dir>/latest``, or ``None`` when there is no such file."""
    path = os.path.join(load_dir, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


# --- what goes into the model-states file -------------------------------------------------------
def persistent_buffer_names(module: torch.nn.Module) -> list[str]:
    """Fully-qualified names of the buffers that ``module.state_dict()`` includes."""
    names = []
    for prefix, owner in module.named_modules():
        for name, buf in owner.named_buffers(recurse=False):
            if buf is not None and name not in owner._non_persistent_buffers_set:
                names.append(f"{prefix}.{name}" if prefix else name)
    return names


def _full_shape(param: torch.nn.Parameter) -> torch.Size:
    # ZeRO-3 parameters are empty placeholders whose logical shape is ``ds_shape`` (public attribute).
    return getattr(param, "ds_shape", param.shape)


def _param_names(module: torch.nn.Module) -> dict[int, str]:
    """``id(param) -> name``; a tied parameter appears once, under its first (owner) name."""
    return {id(p): name for name, p in module.named_parameters()}


def zero_param_shapes(module: torch.nn.Module, optimizer: Any) -> list[OrderedDict]:
    """Per optimizer group, ``{name: full shape}`` in the order of the optimizer's flat groups."""
    groups_fn = getattr(optimizer, "checkpoint_param_groups", None)
    if groups_fn is None:
        raise TypeError(
            f"{type(optimizer).__name__} cannot write a ZeRO checkpoint: it must implement "
            "checkpoint_param_groups() (see ShardedCheckpointOptimizer in deepspeed/_core/checkpoint/save_load.py)"
        )
    names = _param_names(module)
    shapes = []
    for group in groups_fn():
        missing = [tuple(p.shape) for p in group if id(p) not in names]
        if missing:
            raise ValueError(f"optimizer parameters with shapes {missing} are not parameters of the engine's module")
        shapes.append(OrderedDict((names[id(p)], _full_shape(p)) for p in group))
    return shapes


def frozen_param_state(module: torch.nn.Module) -> tuple[OrderedDict, OrderedDict]:
    """``({name: full shape}, {name: this rank's CPU fragment})`` of the parameters that do not train."""
    shapes: OrderedDict = OrderedDict()
    fragments: OrderedDict = OrderedDict()
    for name, p in module.named_parameters():
        if p.requires_grad:
            continue
        shapes[name] = _full_shape(p)
        # Under ZeRO-3 a rank holds only its partition (``ds_tensor``, read from its swap file when it has one);
        # otherwise the whole tensor.
        state = zero_state(p)
        fragments[name] = p.detach().to("cpu", copy=True) if state is None else state.read_shard()
    return shapes, fragments


def shared_params(module: torch.nn.Module) -> dict[str, str]:
    """``{alias_name: owner_name}`` for parameters reachable under more than one name (tied weights)."""
    owners: dict[Any, str] = {}
    aliases: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        key = getattr(p, "ds_id", None)
        if key is None:
            # Empty tensors can share a data pointer without sharing data, so identity decides for them.
            key = ("ptr", p.data_ptr()) if p.numel() else ("id", id(p))
        if key in owners:
            aliases[name] = owners[key]
        else:
            owners[key] = name
    return aliases


def compact_tensors(state: Any) -> Any:
    """Copy to CPU only the tensors that view a larger storage, so files hold no unrelated bytes.

    ``torch.save`` writes whole storages: a parameter viewing a flat ZeRO buffer would otherwise
    pull in the entire buffer. Tensors that own their storage are saved as they are (no copy).
    """
    if torch.is_tensor(state):
        view = state.untyped_storage().nbytes() > state.numel() * state.element_size()
        return state.detach().to("cpu", copy=True) if view else state.detach()
    if isinstance(state, dict):
        out: Any = type(state)((k, compact_tensors(v)) for k, v in state.items())
        if hasattr(state, "_metadata"):
            out._metadata = state._metadata
        return out
    if isinstance(state, (list, tuple)):
        return type(state)(compact_tensors(v) for v in state)
    return state


def build_model_state(
    subject: CheckpointSubject, request: SaveRequest, module_state: dict | None, counters: dict, client_state: dict
) -> dict:
    """The model-states dictionary with upstream's keys, then ``client_state`` merged on top."""
    topo = subject.topology
    opt = subject.optimizer
    frozen: tuple[OrderedDict | None, OrderedDict | None] = (None, None)
    if topo.saves_frozen_params and not request.exclude_frozen_parameters:
        frozen = frozen_param_state(subject.module)
    state = {
        "module": compact_tensors(module_state),
        "buffer_names": persistent_buffer_names(subject.module),
        "optimizer": opt.state_dict()
        if opt is not None and not topo.shards_optimizer and subject.moe is None
        else None,
        "param_shapes": zero_param_shapes(subject.module, opt) if opt is not None and topo.shards_optimizer else None,
        "frozen_param_shapes": frozen[0],
        "frozen_param_fragments": frozen[1],
        "shared_params": shared_params(subject.module),
        "lr_scheduler": subject.lr_scheduler.state_dict() if subject.lr_scheduler is not None else None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": counters["skipped_steps"],
        "global_steps": counters["global_steps"],
        "global_samples": counters["global_samples"],
        "dp_world_size": topo.dp_world_size,
        "mp_world_size": topo.mp_world_size,
        CHECKPOINT_PARALLEL_DIMS: {"pp_degree": _pipe_degree(subject), "tp_degree": _tp_degree(subject)},
        "ds_config": subject.ds_config,
        "ds_version": subject.ds_version,
    }
    state.update(client_state)
    return state


def _pipe_degree(subject: CheckpointSubject) -> int:
    return subject.module_files.pipe_degree if subject.module_files is not None else 1


def _tp_degree(subject: CheckpointSubject) -> int:
    # mp_world_size spans a whole model replica; with pipeline stages part of it is the pipe degree.
    return max(1, subject.topology.mp_world_size // _pipe_degree(subject))


def build_optimizer_shard(subject: CheckpointSubject) -> dict:
    """The ``*_optim_states.pt`` payload of this rank."""
    return {
        OPTIMIZER_STATE_DICT: compact_tensors(subject.optimizer.state_dict()),
        "ds_config": subject.ds_config,
        "ds_version": subject.ds_version,
    }


# --- save ---------------------------------------------------------------------------------------
def save_checkpoint(
    subject: CheckpointSubject,
    request: SaveRequest,
    module_state_fn: Callable[[], dict],
    counters: dict,
    client_state: dict,
) -> None:
    """Write this rank's files, agree with every rank that they are committed, then move ``latest``.

    Must be called on every rank. A failure on any rank raises on every rank and leaves ``latest``
    untouched.
    """
    _validate_tag(request.tag, request.tag_validation)
    ckpt_dir = os.path.join(request.save_dir, request.tag)
    opt = subject.optimizer
    error: BaseException | None = None
    _optional_call(opt, "checkpoint_event_prologue")
    try:
        os.makedirs(ckpt_dir, exist_ok=True)
        module_state_fn = _save_expert_files(subject, ckpt_dir, module_state_fn)
        if subject.topology.writes_model_file:
            if subject.module_files is not None:
                subject.module_files.save(ckpt_dir, request.exclude_frozen_parameters)
                module_state = None
            else:
                module_state = module_state_fn()
            state = build_model_state(subject, request, module_state, counters, client_state)
            io.atomic_save(state, os.path.join(ckpt_dir, model_file_name(subject.topology)))
        if opt is not None and subject.topology.shards_optimizer:
            path = os.path.join(ckpt_dir, optim_file_name(subject.topology, subject.topology.dp_rank))
            io.atomic_save(build_optimizer_shard(subject), path)
    except Exception as err:  # noqa: BLE001 - re-raised below, after the other ranks learn of it
        error = err
    finally:
        _optional_call(opt, "checkpoint_event_epilogue")
    _agree_or_raise(error, f"saving checkpoint '{ckpt_dir}'")
    try:
        if subject.topology.is_coordinator:
            _write_coordinator_files(subject, request)
    except Exception as err:  # noqa: BLE001 - same agreement as above
        error = err
    _agree_or_raise(error, f"updating '{os.path.join(request.save_dir, LATEST_FILE)}'")


def _save_expert_files(
    subject: CheckpointSubject, ckpt_dir: str, module_state_fn: Callable[[], dict]
) -> Callable[[], dict]:
    """MoE models: write this rank's expert files (and stage-0 expert optimizer file); the shared state remains."""
    moe = subject.moe
    if moe is None:
        return module_state_fn
    mp_rank = subject.topology.mp_rank
    shared, experts = moe_ckpt.split_state(module_state_fn(), moe)
    for (layer_id, expert_id), entries in experts.items():
        name = moe_ckpt.expert_file_name(layer_id, expert_id, mp_rank)
        io.atomic_save(compact_tensors(entries), os.path.join(ckpt_dir, name))
    opt = subject.optimizer
    if opt is not None and not subject.topology.shards_optimizer and moe.edp_rank == 0:
        name = moe_ckpt.expert_optim_file_name(moe.ep_rank, mp_rank)
        payload = {"optimizer": compact_tensors(opt.state_dict()), "ds_version": subject.ds_version}
        io.atomic_save(payload, os.path.join(ckpt_dir, name))
    return lambda: shared


def _read_expert_files(subject: CheckpointSubject, request: LoadRequest, ckpt_dir: str, state: dict) -> dict:
    """MoE models: ``state`` with this rank's experts merged into ``module`` (and its stage-0 optimizer)."""
    moe = subject.moe
    if moe is None:
        return state
    rank, mp_rank = dist.get_rank(), subject.topology.mp_rank
    module = type(state["module"])(state["module"])
    if hasattr(state["module"], "_metadata"):
        module._metadata = state["module"]._metadata
    for layer, local, name in moe_ckpt.wanted_expert_files(moe, mp_rank):
        entries = io.load_file(os.path.join(ckpt_dir, name), rank, request.trust)
        module.update(moe_ckpt.localise(entries, layer, local))
    state = {**state, "module": module}
    wants_optimizer = request.optimizer_states and not request.module_only
    if subject.optimizer is not None and not subject.topology.shards_optimizer and wants_optimizer:
        path = os.path.join(ckpt_dir, moe_ckpt.expert_optim_file_name(moe.ep_rank, mp_rank))
        saved = io.load_file(path, rank, request.trust)
        io.require_keys(saved, ["optimizer"], path, rank)
        state["optimizer"] = saved["optimizer"]
    return state


def _write_coordinator_files(subject: CheckpointSubject, request: SaveRequest) -> None:
    if subject.topology.shards_optimizer and subject.zero_to_fp32_source:
        io.atomic_copy(subject.zero_to_fp32_source, os.path.join(request.save_dir, ZERO_TO_FP32_SCRIPT))
    # Written last: until this rename, readers of ``latest`` still see the previous complete tag.
    if request.save_latest:
        io.atomic_write_text(request.tag, os.path.join(request.save_dir, LATEST_FILE))


def _validate_tag(tag: str, mode: str) -> None:
    """All ranks must save under one tag; ``mode`` is the ``checkpoint.tag_validation`` setting."""
    if mode == "IGNORE" or dist.get_world_size() == 1:
        return
    tags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(tags, tag)
    if len(set(tags)) > 1:
        msg = f"save_checkpoint was called with different tags on different ranks: {tags}"
        if mode == "FAIL":
            raise ValueError(msg)
        logger.warning(msg)


def _agree_or_raise(error: BaseException | None, what: str) -> None:
    """Collective: every rank learns whether any rank failed, so none waits forever for a dead peer."""
    failed = torch.tensor([1 if error is not None else 0], device=get_accelerator().current_device_name())
    if dist.get_world_size() > 1:
        sum_over(failed, None)
    if error is not None:
        raise error
    if int(failed.item()):
        raise io.CheckpointError(
            f"{what} failed on {int(failed.item())} other rank(s); see their errors", what, dist.get_rank()
        )


def _optional_call(obj: Any, name: str) -> None:
    method = getattr(obj, name, None)
    if callable(method):
        method()


# --- load ---------------------------------------------------------------------------------------
def load_checkpoint(subject: CheckpointSubject, request: LoadRequest) -> LoadOutcome | None:
    """Restore module, optimizer and scheduler from ``<load_dir>/<tag>``; ``None`` when there is no tag.

    With ``tag=None`` the tag comes from ``<load_dir>/latest``; when that file is missing a warning is
    logged and ``None`` returned (upstream's behaviour). Counters are left to the caller, which reads
    them from :attr:`LoadOutcome.state`.
    """
    tag = request.tag if request.tag is not None else read_latest(request.load_dir)
    if tag is None:
        logger.warning(
            f"no '{LATEST_FILE}' file in '{request.load_dir}' and no tag given: nothing loaded. Pass tag=... "
            "or save with save_latest=True"
        )
        return None
    ckpt_dir = os.path.join(request.load_dir, str(tag))
    opt = subject.optimizer
    _optional_call(opt, "checkpoint_event_prologue")
    try:
        state, shards = _read_rank_files(subject, request, ckpt_dir)
        _apply_module(subject, request, state, ckpt_dir)
        _apply_optimizer(subject, request, state, shards)
        _apply_scheduler(subject, request, state)
    finally:
        _optional_call(opt, "checkpoint_event_epilogue")
    return LoadOutcome(path=ckpt_dir, state=state, client_state=client_state_of(state, request))


def _read_rank_files(subject: CheckpointSubject, request: LoadRequest, ckpt_dir: str) -> tuple[dict, list]:
    """Read this rank's model-states file and the optimizer shards it needs, agreeing on success."""
    rank = dist.get_rank()
    state: dict = {}
    shards: list = []
    error: BaseException | None = None
    try:
        model_path = os.path.join(ckpt_dir, model_file_name(subject.topology))
        if subject.topology.model_file_per_dp_rank and not os.path.exists(model_path):
            # Elastic ZeRO-3 resume on more ranks than saved: the per-rank model files differ only in
            # their frozen-parameter fragments, so a new rank starts from dp rank 0's file.
            model_path = os.path.join(ckpt_dir, model_file_name(subject.topology, dp_rank=0))
        state = io.load_file(model_path, rank, request.trust)
        io.require_keys(state, ["module"], model_path, rank)
        state = _read_expert_files(subject, request, ckpt_dir, state)
        wants_shards = request.optimizer_states and not request.module_only
        if subject.optimizer is not None and subject.topology.shards_optimizer and wants_shards:
            saved_dp = int(state.get("dp_world_size", subject.topology.dp_world_size))
            shards = _read_optimizer_shards(subject, request, ckpt_dir, saved_dp)
            check = getattr(subject.optimizer, "checkpoint_check_shards", None)
            if callable(check):
                check(shards)
    except Exception as err:  # noqa: BLE001 - re-raised after the agreement below
        error = err
    # Later steps may run collectives (ZeRO load); no rank may enter them while another has failed.
    _agree_or_raise(error, f"reading checkpoint '{ckpt_dir}'")
    return state, shards


def _read_optimizer_shards(
    subject: CheckpointSubject, request: LoadRequest, ckpt_dir: str, saved_dp_world_size: int
) -> list:
    """``state_dict_list`` for the optimizer: index = saved dp rank; ``None`` for shards not read."""
    pick = getattr(subject.optimizer, "checkpoint_shard_ranks", None)
    wanted = set(pick(saved_dp_world_size)) if callable(pick) else set(range(saved_dp_world_size))
    rank = dist.get_rank()
    shards: list = []
    for dp_rank in range(saved_dp_world_size):
        if dp_rank not in wanted:
            shards.append(None)
            continue
        path = _existing_optim_file(subject.topology, ckpt_dir, dp_rank)
        shard = io.load_file(path, rank, request.trust)
        io.require_keys(shard, [OPTIMIZER_STATE_DICT], path, rank)
        shards.append(shard[OPTIMIZER_STATE_DICT])
    return shards


def _existing_optim_file(topo: CheckpointTopology, ckpt_dir: str, dp_rank: int) -> str:
    candidates = [os.path.join(ckpt_dir, name) for name in _optim_file_candidates(topo, dp_rank)]
    for path in candidates:
        if os.path.isfile(path):
            return path
    # Report the name this configuration would have written; load_file raises the missing-file error.
    return candidates[0]


def _apply_module(subject: CheckpointSubject, request: LoadRequest, state: dict, ckpt_dir: str) -> None:
    if subject.module_files is not None:
        if request.custom_load_fn is not None:
            raise ValueError(
                "load_checkpoint: custom_load_fn is not supported for a pipeline module (its "
                "weights are in per-layer files); load them with module.load_state_dir instead"
            )
        shards_follow = (
            subject.optimizer is not None
            and subject.topology.shards_optimizer
            and request.optimizer_states
            and not request.module_only
        )
        saved = {name for group in (state.get("param_shapes") or []) for name in group} if shards_follow else None
        subject.module_files.load(ckpt_dir, request.module_strict, request.trust, saved)
        return
    if request.custom_load_fn is not None:
        request.custom_load_fn(src=state["module"], dst=subject.module)
    else:
        subject.module.load_state_dict(state["module"], strict=request.module_strict)


def _apply_optimizer(subject: CheckpointSubject, request: LoadRequest, state: dict, shards: list) -> None:
    opt = subject.optimizer
    if opt is None:
        return
    wanted = request.optimizer_states and not request.module_only
    if subject.topology.shards_optimizer and wanted:
        opt.load_state_dict(shards, load_optimizer_states=True, load_from_fp32_weights=subject.load_from_fp32_weights)
        return
    saved = state.get("optimizer")
    if wanted and saved is not None:
        opt.load_state_dict(saved)
        return
    if wanted:
        logger.warning("the checkpoint holds no optimizer state; fp32 masters are rebuilt from the loaded weights")
    # The module weights just changed under the optimizer: masters must follow them, or the next
    # step would write the old masters back over the loaded weights.
    refresh_fp32_params(opt)


def refresh_fp32_params(optimizer: Any) -> None:
    """Make the optimizer's fp32 masters equal to the current model weights."""
    refresh = getattr(optimizer, "refresh_fp32_params", None)
    if callable(refresh):
        refresh()


def _apply_scheduler(subject: CheckpointSubject, request: LoadRequest, state: dict) -> None:
    if request.module_only or not request.lr_scheduler_states or subject.lr_scheduler is None:
        return
    saved = state.get("lr_scheduler")
    if saved is not None:
        subject.lr_scheduler.load_state_dict(saved)


def client_state_of(state: dict, request: LoadRequest) -> dict:
    """The entries of the model-states dict the engine did not consume (upstream's rule)."""
    consumed = {"module"} if request.module_only else set(_ENGINE_KEYS)
    if request.lr_scheduler_states:
        consumed.add("lr_scheduler")
    if request.optimizer_states:
        consumed.add("optimizer")
    return {k: v for k, v in state.items() if k not in consumed}
