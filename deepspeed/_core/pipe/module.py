"""``PipelineModule``: a model given as a list of layer specs, of which each rank builds only its own stage.

Layers are ``LayerSpec`` / ``TiedLayerSpec`` (built lazily), ``nn.Module`` instances or plain callables. The
partition (see :mod:`deepspeed._core.pipe.partition`) is computed before anything is built; counting parameters
for ``partition_method='parameters'`` builds each spec on the meta device, so no rank ever materialises layers of
another stage. The module's ``forward`` runs the local layers in order, optionally under activation checkpointing.

[Note: checkpointing inputs without grad] A reentrant checkpoint only makes its parameters' gradients flow when
one of its tensor inputs requires grad. The first stage's input (token ids into an embedding) never does, so a
reentrant checkpoint there would silently drop the embedding's gradients (or raise "element 0 of tensors does not
require grad"). When no tensor input of a checkpointed chunk requires grad, the chunk is checkpointed with the
non-reentrant variant instead, which recomputes the same way but keeps the graph to the parameters.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from deepspeed._core.comm import dist
from deepspeed._core.comm.collectives import broadcast_tensor, sum_over
from deepspeed._core.engine import activation_checkpoint as _ac
from deepspeed._core.pipe import checkpoint as _ckpt
from deepspeed._core.pipe.partition import PartitionError, parse_method, partition_layers
from deepspeed._core.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid, ProcessTopology
from deepspeed._foundation.logging import log_dist


class LayerSpec:
    """A layer described by its class and constructor arguments, built only where it is needed.

    ``LayerSpec(nn.Linear, 512, 512)`` builds ``nn.Linear(512, 512)`` when :meth:`build` is called.
    """

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec: typename must be a torch.nn.Module subclass, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"

    def build(self, log: bool = False) -> nn.Module:
        """Construct the layer."""
        if log:
            log_dist(f"building {self!r}", ranks=[0])
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose module (and so its ``tied_weight_attr`` weights) is shared by every spec with the same key.

    The module is built once per stage that uses the key; stages that share it keep the weights equal by
    broadcasting them at construction and all-reducing their gradients. ``forward_fn(module, x)``, when given,
    replaces ``module(x)`` at this position (e.g. an output head reusing an embedding's weight).
    """

    def __init__(
        self,
        key: str,
        typename: type,
        *module_args: Any,
        forward_fn: Callable[..., Any] | None = None,
        tied_weight_attr: str | list[str] = "weight",
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = tied_weight_attr


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed % (2**32))


def _class_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    return type(layer).__name__


def _count_params(layer: Any) -> int:
    """Parameters of a layer without materialising it (LayerSpecs are built on the meta device)."""
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters())
    if not isinstance(layer, LayerSpec):
        return 0
    # The meta build must not move the RNG: seed_layers and reference models depend on its position.
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                module = layer.build()
        except Exception:  # noqa: BLE001 - a constructor that cannot run on meta: build it, count, drop it
            module = layer.build()
    return sum(p.numel() for p in module.parameters())


def _resolve_attr(module: nn.Module, dotted: str) -> torch.Tensor:
    value: Any = module
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _tied_attrs(spec: TiedLayerSpec) -> list[str]:
    attrs = spec.tied_weight_attr
    return [attrs] if isinstance(attrs, str) else list(attrs)


def _resolve_topology(num_stages: int | None, topology: ProcessTopology | None, world: int) -> ProcessTopology:
    """The topology to build, checked against the world (raises naming the argument; no collective)."""
    if topology is None and num_stages is None:
        raise ValueError("PipelineModule: give num_stages or topology")
    if topology is not None:
        if topology.world_size() != world:
            raise ValueError(
                f"PipelineModule: topology has {topology.world_size()} ranks "
                f"({dict(zip(topology.axes, topology.dims, strict=True))}) but the world size is {world}"
            )
        pipe = topology.get_dim("pipe")
        if pipe < 1:
            raise ValueError(f"PipelineModule: topology must have a 'pipe' axis, has {topology.get_axis_names()}")
        if num_stages is not None and num_stages != pipe:
            raise ValueError(
                f"PipelineModule: num_stages={num_stages} disagrees with the topology's pipe dimension {pipe}"
            )
        return topology
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"PipelineModule: num_stages must be a positive int, got {num_stages!r}")
    if world % num_stages:
        raise ValueError(f"PipelineModule: num_stages={num_stages} does not divide the world size {world}")
    return PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)


def _check_fill(num_layers: int, num_stages: int) -> None:
    if num_layers < num_stages:
        raise PartitionError(
            f"PipelineModule: {num_layers} layers cannot fill {num_stages} "
            f"pipeline stages (every stage needs at least one layer)"
        )


def _check_layers(layers: Sequence[Any]) -> list[Any]:
    layers = list(layers)
    if not layers:
        raise ValueError("PipelineModule: layers is empty")
    for idx, layer in enumerate(layers):
        if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
            raise TypeError(
                f"PipelineModule: layers[{idx}] is {type(layer).__name__}; expected a LayerSpec, "
                f"TiedLayerSpec, torch.nn.Module or callable"
            )
    return layers


class PipelineModule(nn.Module):
    """A sequential model split into pipeline stages; this rank holds and runs only its stage's layers.

    Args:
        layers: the whole model in order: LayerSpec / TiedLayerSpec / nn.Module / callable.
        num_stages: pipeline depth (the rest of the world becomes data parallelism); or give ``topology``.
        topology: a :class:`ProcessTopology` with a ``pipe`` axis spanning the world.
        loss_fn: ``loss_fn(outputs, labels)``, called by the engine on the last stage.
        seed_layers: seed the RNG with ``base_seed + layer index`` before building each layer (with ``seed_fn``
            when given), so every layer's initialisation is independent of the partition.
        partition_method: ``'parameters'`` (default), ``'uniform'`` or ``'type:<regex>'``.
        activation_checkpoint_interval: checkpoint every this many layers (0: off).
        activation_checkpoint_func: the checkpoint function (``deepspeed.checkpointing.checkpoint`` by default).
        checkpointable_layers: class names whose chunks may be checkpointed (default: chunks with parameters).
    """

    def __init__(
        self,
        layers: Sequence[Any],
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable[..., Any] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] | None = None,
        checkpointable_layers: list[str] | None = None,
    ) -> None:
        super().__init__()
        # Everything that can be wrong is checked before the first collective (the grid's new_group calls).
        if not dist.is_initialized():
            raise RuntimeError("PipelineModule needs deepspeed.comm initialised (call deepspeed.init_distributed())")
        self._layer_specs = _check_layers(layers)
        self._num_layers = len(self._layer_specs)
        self._topo = _resolve_topology(num_stages, topology, dist.get_world_size())
        self.num_stages = self._topo.get_dim("pipe")
        _validate_checkpointing(activation_checkpoint_interval, checkpointable_layers)
        parse_method(partition_method)
        _check_fill(self._num_layers, self.num_stages)
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func or _default_checkpoint
        self.checkpointable_layers = checkpointable_layers
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = self.global_rank  # upstream attribute; the engine uses the launcher's LOCAL_RANK
        self._build_local_stage()

    # ------------------------------------------------------------------ construction
    def _build_local_stage(self) -> None:
        """Partition the layers over the stages, build this rank's, and tie the weights shared across stages."""
        self.parts = self._partition()
        self._grid = PipelineParallelGrid(topology=self._topo)
        self.stage_id = self._topo.get_coord(self.global_rank).pipe
        self._local_start, self._local_stop = self.parts[self.stage_id], self.parts[self.stage_id + 1]
        self.micro_offset = 0
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.forward_funcs: list[Callable[..., Any]] = []
        self._layer_modules: list[nn.Module | None] = []
        self._build()
        self.tied_comms = self._index_tied_modules()
        self._synchronize_tied_weights()

    def _partition(self) -> list[int]:
        kind, _ = parse_method(self.partition_method)
        counts = [_count_params(layer) for layer in self._layer_specs] if kind == "parameters" else None
        names = [_class_name(layer) for layer in self._layer_specs]
        parts = partition_layers(self.partition_method, self.num_stages, names, counts)
        log_dist(f"pipeline partition ({self.partition_method}): {parts}", ranks=[0])
        return parts

    def _seed(self, idx: int) -> None:
        if not self.seed_layers:
            return
        (self.seed_fn or _seed_everything)(self.base_seed + idx)

    def _build(self) -> None:
        """Build the layers ``[_local_start, _local_stop)``; tied modules once per key."""
        for idx in range(self._local_start, self._local_stop):
            layer = self._layer_specs[idx]
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self._seed(idx)
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = _tied_attrs(layer)
                module = self.tied_modules[layer.key]
                func = module if layer.forward_fn is None else partial(layer.forward_fn, module)
                self.forward_funcs.append(func)
                self._layer_modules.append(module)
            elif isinstance(layer, LayerSpec):
                self._seed(idx)
                module = layer.build()
                self.add_module(str(idx), module)
                self.forward_funcs.append(module)
                self._layer_modules.append(module)
            elif isinstance(layer, nn.Module):
                self.add_module(str(idx), layer)
                self.forward_funcs.append(layer)
                self._layer_modules.append(layer)
            else:
                self.forward_funcs.append(layer)
                self._layer_modules.append(None)

    def _tied_stages(self) -> dict[str, list[int]]:
        """For each tied key (in order of first use), the stages that hold it."""
        stages: dict[str, list[int]] = {}
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                stage = next(s for s in range(self.num_stages) if self.parts[s] <= idx < self.parts[s + 1])
                holders = stages.setdefault(layer.key, [])
                if stage not in holders:
                    holders.append(stage)
        return stages

    def _index_tied_modules(self) -> dict[str, dict[str, Any]]:
        """Groups of the ranks sharing each tied key across stages (every rank creates every group, in order)."""
        comms: dict[str, dict[str, Any]] = {}
        other_axes = [a for a in self._topo.get_axis_names() if a != "pipe"]
        for key, stages in self._tied_stages().items():
            if len(stages) < 2:
                continue
            for combo in _axis_products(self._topo, other_axes):
                ranks = [self._topo.get_rank(pipe=s, **combo) for s in stages]
                group = dist.new_group(ranks=ranks)
                if self.global_rank in ranks:
                    comms[key] = {
                        "ranks": ranks,
                        "group": group,
                        "weight_attr": self.tied_weight_attrs[key],
                        "module": self.tied_modules[key],
                    }
        return comms

    # ------------------------------------------------------------------ tied weights
    def get_tied_weights_and_groups(self) -> list[tuple[torch.Tensor, Any]]:
        """``(weight, group)`` for each tied weight this stage shares with other stages."""
        pairs = []
        for comm in self.tied_comms.values():
            for attr in comm["weight_attr"]:
                pairs.append((_resolve_attr(comm["module"], attr), comm["group"]))
        return pairs

    def allreduce_tied_weight_gradients(self) -> None:
        """Sum the gradients of shared tied weights over the stages holding them (each stage then steps alike)."""
        for weight, group in self.get_tied_weights_and_groups():
            if weight.grad is not None:
                sum_over(weight.grad, group)

    def _synchronize_tied_weights(self) -> None:
        """Make every stage's copy of a tied weight equal to the copy of its first holder."""
        for comm in self.tied_comms.values():
            for attr in comm["weight_attr"]:
                weight = _resolve_attr(comm["module"], attr)
                with torch.no_grad():
                    broadcast_tensor(weight.data, min(comm["ranks"]), comm["group"])

    # ------------------------------------------------------------------ forward
    def forward(self, forward_input: Any) -> Any:
        """Run this stage's layers on ``forward_input`` (checkpointing every ``activation_checkpoint_interval``)."""
        self.micro_offset += 1
        interval = self.activation_checkpoint_interval
        if interval == 0 or not torch.is_grad_enabled():
            return self._exec_range(0, len(self.forward_funcs))(forward_input)
        x = forward_input
        for start in range(0, len(self.forward_funcs), interval):
            stop = min(start + interval, len(self.forward_funcs))
            run = self._exec_range(start, stop)
            if not self._is_checkpointable(self.forward_funcs[start:stop]):
                x = run(x)
                continue
            args = x if isinstance(x, tuple) else (x,)
            if any(torch.is_tensor(a) and a.requires_grad for a in args):
                x = self.activation_checkpoint_func(run, *args)
            else:  # [Note: checkpointing inputs without grad]
                x = _ac.non_reentrant_checkpoint(run, args)
        return x

    def _exec_range(self, start: int, stop: int) -> Callable[..., Any]:
        funcs = self.forward_funcs[start:stop]

        def run(*inputs: Any) -> Any:
            x: Any = inputs[0] if len(inputs) == 1 else inputs
            for func in funcs:
                x = func(x)
            return x

        return run

    def _is_checkpointable(self, funcs: list[Callable[..., Any]]) -> bool:
        if self.checkpointable_layers is not None:
            return any(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)

    # ------------------------------------------------------------------ checkpoints
    def ckpt_prefix(self, checkpoints_path: str, tag: str) -> str:
        """Path prefix of this rank's files in ``<checkpoints_path>/<tag>`` (upstream helper)."""
        rank_name = "module"
        rank_repr = self._topo.get_rank_repr(rank=self.global_rank)
        if rank_repr:
            rank_name += f"-{rank_repr}"
        return os.path.join(checkpoints_path, str(tag), rank_name)

    def ckpt_layer_path(self, ckpt_dir: str, local_layer_idx: int) -> str:
        """File of local layer ``local_layer_idx``: ``layer_<global idx>[-<rank_repr>]-model_states.pt``."""
        idx = self._local_start + local_layer_idx
        return os.path.join(ckpt_dir, _ckpt.layer_file_name(idx, self._topo.get_rank_repr(rank=self.global_rank)))

    def ckpt_layer_path_list(self, ckpt_dir: str, local_layer_idx: int) -> list[str]:
        """Every saved file of local layer ``local_layer_idx`` (one per tensor-parallel slice)."""
        return _ckpt.layer_files_of(ckpt_dir, self._local_start + local_layer_idx)

    def save_state_dict(
        self, save_dir: str, checkpoint_engine: Any = None, exclude_frozen_params: bool = False
    ) -> None:
        """Write one file per local layer into ``save_dir`` (data-parallel rank 0 of each stage writes)."""
        _ckpt.save_layers(self, save_dir, checkpoint_engine, exclude_frozen_params)

    def load_state_dir(self, load_dir: str, checkpoint_engine: Any = None, strict: bool = True) -> None:
        """Load every local layer from ``load_dir`` and re-synchronise tied weights (collective: call on all ranks)."""
        _ckpt.load_layers(self, load_dir, checkpoint_engine, strict)

    # ------------------------------------------------------------------ queries
    def topology(self) -> ProcessTopology:
        """The process topology the module was partitioned over."""
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        """The grid of process groups (a Megatron-style ``mpu``)."""
        return self._grid

    def num_pipeline_stages(self) -> int:
        """Number of pipeline stages."""
        return self.num_stages

    def stage_layer_range(self) -> tuple[int, int]:
        """Global indices ``[start, stop)`` of this stage's layers."""
        return self._local_start, self._local_stop

    def local_layer_modules(self) -> list[nn.Module | None]:
        """The module behind each local layer position (the shared module for tied layers, None for callables)."""
        return list(self._layer_modules)


def _default_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``deepspeed.checkpointing.checkpoint``'s mechanism (the façade forwards to the same function)."""
    return _ac.checkpoint(function, args, {})


def _validate_checkpointing(interval: Any, checkpointable_layers: Any) -> None:
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise ValueError(f"PipelineModule: activation_checkpoint_interval must be an int >= 0, got {interval!r}")
    if checkpointable_layers is not None and (
        not isinstance(checkpointable_layers, (list, tuple))
        or not all(isinstance(n, str) for n in checkpointable_layers)
    ):
        raise TypeError(
            f"PipelineModule: checkpointable_layers must be a list of class names, got {checkpointable_layers!r}"
        )


def _axis_products(topo: ProcessTopology, axes: list[str]) -> list[dict[str, int]]:
    combos: list[dict[str, int]] = [{}]
    for axis in axes:
        combos = [dict(c, **{axis: i}) for c in combos for i in range(topo.get_dim(axis))]
    return combos


__all__ = ["LayerSpec", "TiedLayerSpec", "PipelineModule", "PartitionError"]
