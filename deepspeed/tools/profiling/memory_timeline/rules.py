"""Classification rules: which allocation belongs to which memory category, decided from its Python stack.

A :class:`Rule` matches a frame when its ``path`` is a substring of the frame's file name (``/``-separated) and,
if it names functions, the frame's function matches one of its glob patterns. A rule whose category is ``None``
matches without deciding: the frame is skipped, as if no rule matched it (generic helpers that allocate for
whoever calls them; :data:`HELPER_RULES` gives them a category when nothing else decided).

This package's rules go by *room* (the folders of ``deepspeed/_core``), so they follow the code as it moves inside
a room: ``params/`` (ZeRO-3 gather, hooks, prefetch) and the all-gathers of ``comm/collectives.py`` make gathered
parameters, ``grads/`` and ``comm/host_transfer.py`` gradients, ``optim/`` optimizer state, ``layout/`` parameter
storage. Function names appear only where one file serves two categories (the engine room, the gradient side of the
stage-1/2/3 optimizers, ZeRO-3 partitioning); ``tests/unit/test_memory_timeline.py`` checks that every path and
function a rule names for this package exists, so a rule cannot go stale silently. Upstream DeepSpeed
(``deepspeed/runtime/...`` of the upstream package) and PyTorch FSDP2 (``torch/distributed/fsdp/_fully_shard``)
rules classify the baselines' traces and name their functions.

================== ========================================================================================
category           allocation stack contains
================== ========================================================================================
gathered           ours: ``_core/params/`` (except the rows below), ``comm/collectives.py`` all-gathers;
                   upstream: ``partition_parameters.py`` all-gathers, ``partitioned_param_coordinator.py``
                   fetch; FSDP2: ``foreach_all_gather*``, unsharded/all-gather outputs, unshard/prefetch;
                   plus a parameter-release free stack
gradients          ours: ``_core/grads/``, ``params/grad_route.py``, ``comm/host_transfer.py``, the optimizers'
                   ``prepare_backward``/``finish_backward`` and gradient hooks; upstream: reduce/ipg/grad
                   functions; FSDP2: ``foreach_reduce*``, post-backward; plus a gradient free stack
optimizer state    ours: ``_core/optim/``, the engines' ``step``, master weights of ``engine/precision.py``;
                   ``torch/optim``; ``deepspeed/ops``; upstream step and optimizer-state set-up
parameters         ours: ``params/init_context.py``, ``Gatherer.partition``, ``_core/layout/``,
                   ``engine/setup.py``; upstream: fp16/bit16 flat buffers; FSDP2: ``fully_shard``;
                   ``nn.Module.to/_apply``; helpers: ``layout/flat_buffer.py``, ``params/param.py``,
                   ``params/placement.py``, upstream ``partition_parameters.py``, FSDP2 ``_fsdp_param.py``
activations        ``torch/utils/checkpoint.py`` (recompute), activation-checkpointing modules, ``nn.Module``
                   calls, the engines' ``forward``; an empty stack or one through autograd
buffers            everything else (inputs, communication staging, module buffers, workspaces)
================== ========================================================================================

To extend the rules, add a :class:`Rule` to the right table; order matters only between rules that can match the
same frame (the first matching rule of a table decides for that frame).
"""

from __future__ import annotations

import fnmatch
from typing import NamedTuple

CATEGORIES = ("parameters", "gathered parameters", "gradients", "optimizer state", "activations", "buffers")
BEFORE_RECORDING = "before recording"
"""Extra band: blocks alive when recording started that no hint, frame or free stack could place."""
PLOT_CATEGORIES = CATEGORIES + (BEFORE_RECORDING,)

PARAMS, GATHERED, GRADS, OPTIM, ACTS, BUFFERS = CATEGORIES
HELPER = None
"""Category of a rule that matches a frame without deciding (the frame is skipped)."""


class Rule(NamedTuple):
    """One classification rule: a frame matches when ``path`` is a substring of its filename (``/``-separated)
    and, if ``names`` is not empty, its function name matches one of the glob patterns. ``category`` ``None``
    (:data:`HELPER`) matches without deciding."""

    category: str | None
    path: str
    names: tuple[str, ...] = ()

    def matches(self, filename: str, name: str) -> bool:
        """True when a frame with this ``filename`` and function ``name`` matches the rule."""
        if self.path not in filename:
            return False
        return not self.names or any(fnmatch.fnmatchcase(name, pattern) for pattern in self.names)


OURS = "deepspeed/_core/"
"""Path prefix of this package's rules (the ones whose paths and functions the unit tests check)."""
_C = OURS
_UP = "deepspeed/runtime/"
_FSDP = "torch/distributed/fsdp/_fully_shard/"
_UP_GRAD_NAMES = (
    "*reduce*",
    "*ipg*",
    "*_grads*",
    "*gradient*",
    "*grad_to*",
    "average_tensor",
    "*allreduce*",
    "partition_grads",
    "_setup_for_real_optimizer",
    "*accumulate*",
)
_BACKWARD_SIDE = ("prepare_backward", "finish_backward")  # EngineOptimizer's gradient half, every stage
_STAGE3_GRADS = ("_on_grad", "_fold", "flush")  # ZeRO-3 gradient hook and folds (buckets live in grads/)

ALLOC_RULES: tuple[Rule, ...] = (
    # ours, by room; the rows before a room's rule are its exceptions
    Rule(HELPER, _C + "params/param.py"),
    Rule(HELPER, _C + "params/placement.py"),
    Rule(PARAMS, _C + "params/init_context.py"),
    Rule(PARAMS, _C + "params/gather.py", ("partition",)),
    Rule(GRADS, _C + "params/grad_route.py"),
    Rule(GATHERED, _C + "params/"),
    Rule(GATHERED, _C + "comm/collectives.py", ("start_all_gather", "finish_all_gather")),
    Rule(GRADS, _C + "comm/host_transfer.py"),
    Rule(GRADS, _C + "grads/"),
    Rule(GRADS, _C + "optim/", _BACKWARD_SIDE),
    Rule(GRADS, _C + "optim/stage3.py", _STAGE3_GRADS + ("ensure_accumulator",)),
    Rule(GRADS, _C + "optim/stage12.py", ("_grad_partition",)),
    Rule(OPTIM, _C + "optim/"),
    Rule(HELPER, _C + "layout/flat_buffer.py"),
    Rule(PARAMS, _C + "layout/"),
    Rule(GRADS, _C + "engine/data_parallel.py", _BACKWARD_SIDE),
    Rule(OPTIM, _C + "engine/data_parallel.py", ("__init__", "step")),
    Rule(GRADS, _C + "engine/precision.py", ("grads_to_masters",)),
    Rule(OPTIM, _C + "engine/precision.py", ("__init__", "masters_to_working")),
    Rule(PARAMS, _C + "engine/precision.py", ("cast_module_params",)),
    Rule(PARAMS, _C + "engine/setup.py"),
    Rule(ACTS, _C + "engine/activation_checkpoint.py"),
    Rule(OPTIM, _C + "engine/training.py", ("step", "_take_model_step")),
    Rule(ACTS, _C + "engine/training.py", ("forward",)),
    # upstream DeepSpeed and PyTorch FSDP2: gathered parameters
    Rule(
        GATHERED,
        _UP + "zero/partition_parameters.py",
        ("*all_gather*", "*allgather*", "wait", "_ensure_availability_of_partitioned_params"),
    ),
    Rule(GATHERED, _UP + "zero/partitioned_param_coordinator.py", ("*fetch*", "*all_gather*")),
    Rule(
        GATHERED,
        _FSDP + "_fsdp_collectives.py",
        ("foreach_all_gather*", "all_gather_copy_in*", "_get_param_all_gather_inputs"),
    ),
    Rule(
        GATHERED,
        _FSDP + "_fsdp_param.py",
        (
            "*all_gather*",
            "alloc_storage",
            "init_unsharded_param",
            "to_unsharded",
            "unsharded_param",
            "to_sharded_post_forward*",
        ),
    ),
    Rule(GATHERED, _FSDP + "_fsdp_param_group.py", ("*unshard*", "_backward_prefetch", "_to_sharded_post_forward")),
    # gradients
    Rule(GRADS, _UP + "zero/stage3.py", _UP_GRAD_NAMES),
    Rule(GRADS, _UP + "zero/stage_1_and_2.py", _UP_GRAD_NAMES),
    Rule(
        GRADS,
        _UP + "engine.py",
        (
            "allreduce_*",
            "*_gradients",
            "buffered_allreduce_fallback",
            "sparse_allreduce*",
            "_get_gradients_for_reduction",
        ),
    ),
    Rule(GRADS, _FSDP + "_fsdp_collectives.py", ("foreach_reduce*", "_div_if_needed")),
    Rule(GRADS, _FSDP + "_fsdp_param.py", ("*grad*",)),
    Rule(GRADS, _FSDP + "_fsdp_param_group.py", ("post_backward", "finalize_backward")),
    Rule(GRADS, _FSDP + "_fsdp_state.py", ("_root_post_backward_final_callback",)),
    # optimizer state
    Rule(OPTIM, "torch/optim/"),
    Rule(OPTIM, "deepspeed/ops/"),
    Rule(
        OPTIM,
        _UP + "zero/stage3.py",
        ("step", "_optimizer_step", "*fp32*", "initialize_optimizer_states", "_create_momentum_buffer"),
    ),
    Rule(
        OPTIM,
        _UP + "zero/stage_1_and_2.py",
        ("step", "_optimizer_step", "initialize_optimizer_states", "_lazy_init_hp_params_optimizer_state"),
    ),
    Rule(OPTIM, _UP + "bf16_optimizer.py"),
    Rule(OPTIM, _UP + "fp16/"),
    Rule(OPTIM, _UP + "engine.py", ("step", "_take_model_step")),
    # parameters
    Rule(PARAMS, _UP + "zero/stage3.py", ("*fp16*", "*flat*")),
    Rule(PARAMS, _UP + "zero/stage_1_and_2.py", ("*flat*", "*bit16*")),
    Rule(PARAMS, _FSDP + "_fully_shard.py"),
    Rule(PARAMS, _FSDP + "_fsdp_init.py"),
    Rule(PARAMS, "torch/nn/modules/module.py", ("_apply", "to", "cuda", "to_empty", "*load_state_dict*")),
    # activations
    Rule(ACTS, "torch/utils/checkpoint.py"),
    Rule(ACTS, _UP + "activation_checkpointing/"),
    Rule(ACTS, _FSDP + "_fsdp_state.py", ("_cast_forward_inputs", "_cast_output_dtype", "*pre_forward*")),
    Rule(ACTS, "torch/nn/modules/module.py", ("_call_impl", "_wrapped_call_impl")),
    Rule(ACTS, _UP + "engine.py", ("forward",)),
)
"""Decisive rules, checked on the allocation stack innermost frame first."""

HELPER_RULES: tuple[Rule, ...] = (
    Rule(PARAMS, _C + "layout/flat_buffer.py"),
    Rule(PARAMS, _C + "params/param.py"),
    Rule(PARAMS, _C + "params/placement.py"),
    Rule(PARAMS, _UP + "zero/partition_parameters.py"),
    Rule(PARAMS, _FSDP + "_fsdp_param.py"),
)
"""Generic helpers: their category applies only when no frame matched :data:`ALLOC_RULES`."""

FREE_RULES: tuple[Rule, ...] = (
    # gradient reduction and zero_grad: autograd-produced .grad tensors
    Rule(GRADS, _C + "grads/"),
    Rule(GRADS, _C + "params/grad_route.py"),
    Rule(GRADS, _C + "optim/", _BACKWARD_SIDE + ("_clear_grads",)),
    Rule(GRADS, _C + "optim/stage3.py", _STAGE3_GRADS),
    Rule(GRADS, _C + "optim/stage12.py", ("_grad_partition", "step")),
    Rule(GRADS, _C + "engine/data_parallel.py", ("finish_backward", "step")),
    Rule(GRADS, _C + "engine/precision.py", ("grads_to_masters", "drop_master_grads")),
    Rule(GRADS, _UP + "zero/stage3.py", _UP_GRAD_NAMES),
    Rule(GRADS, _UP + "zero/stage_1_and_2.py", _UP_GRAD_NAMES),
    Rule(GRADS, _UP + "engine.py", ("allreduce_*", "*_gradients")),
    Rule(GRADS, _FSDP + "_fsdp_collectives.py", ("foreach_reduce*",)),
    Rule(GRADS, _FSDP + "_fsdp_param.py", ("*grad*",)),
    Rule(GRADS, _FSDP + "_fsdp_param_group.py", ("post_backward", "finalize_backward")),
    Rule(GRADS, "", ("zero_grad",)),
    # parameter release: gathered storage (matters for blocks gathered before recording started)
    Rule(GATHERED, _C + "params/"),
    Rule(GATHERED, _UP + "zero/partitioned_param_coordinator.py", ("*release*",)),
    Rule(GATHERED, _UP + "zero/partition_parameters.py", ("free_param", "*partition*")),
    Rule(GATHERED, _FSDP + "_fsdp_param.py", ("free_unsharded_param", "to_sharded*")),
    Rule(GATHERED, _FSDP + "_fsdp_param_group.py", ("reshard", "post_forward", "_to_sharded*")),
)
"""Free-stack rules, innermost frame first: a generic allocation freed on a gradient path was a gradient, one
freed on a parameter-release path (anything in ``_core/params/`` but the gradient router) was gathered storage."""

BACKWARD_RULES: tuple[Rule, ...] = (
    Rule(ACTS, "torch/autograd/"),
    Rule(ACTS, "torch/_tensor.py", ("backward",)),
    Rule(ACTS, _C + "engine/training.py", ("backward",)),
    Rule(ACTS, _UP + "engine.py", ("backward",)),
)
"""Stacks that make an otherwise unexplained allocation a backward temporary (``activations``)."""
