"""Pipeline checkpoints: one file per layer, in upstream DeepSpeed's pipeline layout.

Inside a checkpoint tag folder a pipeline run holds

* ``layer_<NN>[-<rank_repr>]-model_states.pt``: the state dict of global layer ``NN`` (keys relative to the
  layer), written by data-parallel rank 0 of the stage that owns it; ``rank_repr`` names the tensor-parallel
  slice (``model_01``) when there is a ``model`` axis;
* ``mp_rank_<SS>_model_states.pt``: one per stage (``SS`` = the grid's model-parallel rank, the stage id without
  tensor parallelism), written by the engine's usual machinery with ``module`` set to ``None``;
* ``zero_pp_rank_<D>_mp_rank_<SS>_optim_states.pt``: ZeRO-1 shards, as for any ZeRO run.

Per-layer files make a checkpoint independent of the partition: a run with another partition or another
data-parallel size reads the same layer files. :class:`PipelineModuleFiles` plugs this into
``deepspeed._core.checkpoint.save_load`` (its ``ModuleFiles`` protocol), so there is one checkpoint writer.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch

from deepspeed._core.checkpoint import files as io
from deepspeed._core.checkpoint.save_load import _agree_or_raise, compact_tensors
from deepspeed._core.comm import dist

LAYER_FILE_SUFFIX = "-model_states.pt"


def layer_file_name(layer_idx: int, rank_repr: str = "") -> str:
    """``layer_07-model_states.pt``, or ``layer_07-model_01-model_states.pt`` with a tensor-parallel slice."""
    name = f"layer_{layer_idx:02d}"
    if rank_repr:
        name += f"-{rank_repr}"
    return name + LAYER_FILE_SUFFIX


def layer_state(layer: torch.nn.Module, exclude_frozen_params: bool) -> dict:
    """The layer's state dict to save (frozen parameters dropped on request), compacted for ``torch.save``."""
    state = layer.state_dict()
    if exclude_frozen_params:
        frozen = {name for name, p in layer.named_parameters() if not p.requires_grad}
        for name in frozen:
            state.pop(name, None)
    return compact_tensors(state)


def save_layers(
    module: Any, save_dir: str, checkpoint_engine: Any = None, exclude_frozen_params: bool = False
) -> list[str]:
    """Write every local layer's file (only on data-parallel rank 0); returns the paths written."""
    if module.mpu().get_data_parallel_rank() != 0:
        return []
    os.makedirs(save_dir, exist_ok=True)
    written = []
    for local_idx, layer in enumerate(module.local_layer_modules()):
        if layer is None:
            continue
        path = module.ckpt_layer_path(save_dir, local_idx)
        state = layer_state(layer, exclude_frozen_params)
        if checkpoint_engine is not None:
            checkpoint_engine.save(state, path)
        else:
            io.atomic_save(state, path)
        written.append(path)
    return written


def _read_layer(path: str, checkpoint_engine: Any, trust: io.LoadTrust) -> dict:
    if checkpoint_engine is not None:
        return checkpoint_engine.load(path, map_location="cpu")
    return io.load_file(path, dist.get_rank(), trust)


def _check_same_partition(module: Any, saved_param_names: set[str] | None, load_dir: str) -> None:
    """Optimizer shards are per stage: they only fit a stage that holds the same parameters as when saved."""
    if saved_param_names is None:
        return
    live = {name for name, p in module.named_parameters() if p.requires_grad}
    if live != saved_param_names:
        missing, extra = sorted(saved_param_names - live)[:4], sorted(live - saved_param_names)[:4]
        raise ValueError(
            f"checkpoint '{load_dir}': stage {module.stage_id} now holds other parameters than when it was saved "
            f"(saved only: {missing}, new: {extra}); the partition or the number of stages changed. Load with "
            "load_optimizer_states=False (or load_module_only=True): the layer files fit any partition"
        )


def load_layers(
    module: Any,
    load_dir: str,
    checkpoint_engine: Any = None,
    strict: bool = True,
    trust: io.LoadTrust | None = None,
    saved_param_names: set[str] | None = None,
) -> None:
    """Load every local layer from its file, then re-synchronise tied weights across stages.

    Collective (every rank calls it): the ranks first agree that all of them read their files, so a missing
    or corrupt file (or, when ``saved_param_names`` is given, a stage whose parameters differ from the saved
    ones) raises on every rank instead of leaving the others in the tied-weight broadcast.
    """
    trust = trust if trust is not None else io.LoadTrust.from_env()
    error: BaseException | None = None
    try:
        _check_same_partition(module, saved_param_names, load_dir)
        for local_idx, layer in enumerate(module.local_layer_modules()):
            if layer is None:
                continue
            path = module.ckpt_layer_path(load_dir, local_idx)
            state = _read_layer(path, checkpoint_engine, trust)
            layer.load_state_dict(state, strict=strict)
    except Exception as err:  # noqa: BLE001 - re-raised on every rank by the agreement below
        error = err
    _agree_or_raise(error, f"loading pipeline layer files from '{load_dir}'")
    module._synchronize_tied_weights()


def layer_files_of(ckpt_dir: str, layer_idx: int) -> list[str]:
    """Every file of global layer ``layer_idx`` in ``ckpt_dir`` (one per tensor-parallel slice), sorted."""
    return sorted(glob.glob(os.path.join(ckpt_dir, f"layer_{layer_idx:02d}*{LAYER_FILE_SUFFIX}")))


class PipelineModuleFiles:
    """The ``ModuleFiles`` strategy of the engine's checkpointing for a ``PipelineModule``.

    The engine's model-states file then stores ``module: None`` (as upstream's pipeline engine does) and the
    weights live in the per-layer files.
    """

    def __init__(self, module: Any) -> None:
        self.module = module

    @property
    def pipe_degree(self) -> int:
        """Number of pipeline stages (``checkpoint_parallel_dimensions['pp_degree']``)."""
        return int(self.module.num_stages)

    def save(self, ckpt_dir: str, exclude_frozen_parameters: bool) -> None:
        """Write this stage's layer files (data-parallel rank 0 only)."""
        save_layers(self.module, ckpt_dir, exclude_frozen_params=exclude_frozen_parameters)

    def load(self, ckpt_dir: str, strict: bool, trust: io.LoadTrust, saved_param_names: set[str] | None) -> None:
        """Read this stage's layer files (every rank; collective), refusing shards saved for other parameters."""
        load_layers(self.module, ckpt_dir, strict=strict, trust=trust, saved_param_names=saved_param_names)
