"""``deepspeed.checkpointing``: activation checkpointing with upstream's module-level API.

Typical use (Megatron-style)::

    deepspeed.checkpointing.configure(mpu, deepspeed_config=args.deepspeed_config)
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(seed)
    hidden = deepspeed.checkpointing.checkpoint(layer, hidden, attention_mask)

The engine never configures this module by itself; settings persist until the next :func:`configure`. The
algorithm and the shared state live in :mod:`deepspeed._core.engine.activation_checkpoint`; this module only
parses arguments and forwards. Upstream's settings globals (``PARTITION_ACTIVATIONS``, ``CPU_CHECKPOINT``,
``CONTIGUOUS_CHECKPOINTING``, ``SYNCHRONIZE``, ``PROFILE_TIME``, ``num_layers``, ``mpu``,
``deepspeed_checkpointing_enabled``) remain readable as module attributes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch

from deepspeed._core.engine import activation_checkpoint as _core
from deepspeed._core.engine.activation_checkpoint import CheckpointFunction, CheckpointPolicy, CudaRNGStatesTracker
from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig
from deepspeed.utils.logging import log_dist

__all__ = [
    "CheckpointFunction",
    "CudaRNGStatesTracker",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "set_num_layers",
]

_MODEL_PARALLEL_RNG_TRACKER_NAME = _core.MODEL_PARALLEL_RNG_TRACKER_NAME

# Upstream global name -> how to read it from the shared state (read-only views; assigning them has no effect).
_LEGACY_GLOBALS: dict[str, Callable[[_core.ActivationCheckpointState], Any]] = {
    "PARTITION_ACTIVATIONS": lambda s: s.policy.partition_activations,
    "CONTIGUOUS_CHECKPOINTING": lambda s: s.policy.contiguous_checkpointing,
    "CPU_CHECKPOINT": lambda s: s.policy.checkpoint_in_cpu,
    "SYNCHRONIZE": lambda s: s.policy.synchronize,
    "PROFILE_TIME": lambda s: s.policy.profile,
    "num_layers": lambda s: s.policy.num_checkpoints,
    "mpu": lambda s: s.mpu,
    "deepspeed_checkpointing_enabled": lambda s: s.configured,
}


def __getattr__(name: str) -> Any:
    reader = _LEGACY_GLOBALS.get(name)
    if reader is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return reader(_core.current_state())


# ---------------------------------------------------------------------- configuration
def _activation_block(deepspeed_config: Any, mpu: Any) -> DeepSpeedActivationCheckpointingConfig | None:
    """The ``activation_checkpointing`` block of a DeepSpeedConfig, dict, JSON path, or the block model itself."""
    if deepspeed_config is None:
        return None
    if isinstance(deepspeed_config, DeepSpeedActivationCheckpointingConfig):
        return deepspeed_config
    block = getattr(deepspeed_config, "activation_checkpointing_config", None)
    if block is not None:
        return block
    if isinstance(deepspeed_config, (dict, str, os.PathLike)):
        # Imported here: deepspeed.runtime.config pulls in every config model, which plain checkpoint() users
        # never need.
        from deepspeed.runtime.config import DeepSpeedConfig

        return DeepSpeedConfig(deepspeed_config, mpu=mpu).activation_checkpointing_config
    raise TypeError(
        "deepspeed_config must be a DeepSpeedConfig, a config dict or a path to a JSON config; got "
        f"{type(deepspeed_config).__name__}"
    )


def _policy_from_block(block: DeepSpeedActivationCheckpointingConfig | None) -> CheckpointPolicy:
    if block is None:
        return CheckpointPolicy()
    return CheckpointPolicy(
        partition_activations=block.partition_activations,
        contiguous_checkpointing=block.contiguous_memory_optimization,
        num_checkpoints=block.number_checkpoints,
        checkpoint_in_cpu=block.cpu_checkpointing,
        synchronize=block.synchronize_checkpoint_boundary,
        profile=block.profile,
    )


def configure(
    mpu_: Any,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Set up activation checkpointing.

    Settings start from the defaults, then take the ``activation_checkpointing`` block of ``deepspeed_config``
    (a ``DeepSpeedConfig``, a config dict or a JSON path), then every keyword that is not ``None``.

    Args:
        mpu_: Megatron-style model-parallel unit (``get_tensor_model_parallel_{rank,world_size,group}`` or
            ``get_model_parallel_*``), or ``None`` for no model parallelism.
        deepspeed_config: config whose ``activation_checkpointing`` block is read.
        partition_activations: keep only this rank's share of each saved input across the model-parallel group.
        contiguous_checkpointing: place the partitions in one preallocated buffer per argument.
        num_checkpoints: number of checkpointed calls per forward (sizes the contiguous buffers).
        checkpoint_in_cpu: keep saved inputs in host memory.
        synchronize: synchronize the device at checkpoint boundaries.
        profile: time forward, recompute and backward of checkpointed calls (logged at debug level).

    Raises:
        ValueError: contiguous checkpointing without ``partition_activations`` or without ``num_checkpoints``.
    """
    policy = _policy_from_block(_activation_block(deepspeed_config, mpu_))
    overrides: dict[str, Any] = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "num_checkpoints": num_checkpoints,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    policy = dataclasses.replace(policy, **{k: v for k, v in overrides.items() if v is not None})
    _core.current_state().apply(policy, mpu_)
    log_dist(f"activation checkpointing configured: {policy}", ranks=[0])


def is_configured() -> bool:
    """True once :func:`configure` has been called."""
    return _core.current_state().configured


def reset() -> None:
    """Release the contiguous activation buffers.

    Call it after forward passes that are not followed by a backward (e.g. evaluation with grad enabled) when
    contiguous checkpointing is on; settings are kept.
    """
    _core.current_state().release_buffers()


def set_num_layers(nlayers: int) -> None:
    """Set the number of checkpointed calls per forward (the contiguous buffers' capacity)."""
    state = _core.current_state()
    state.policy = dataclasses.replace(state.policy, num_checkpoints=nlayers)
    state.release_buffers()


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Turn partitioning of saved inputs on or off without reconfiguring anything else."""
    state = _core.current_state()
    state.policy = dataclasses.replace(state.policy, partition_activations=bool(partition_activation))
    state.release_buffers()
    log_dist(f"activation checkpointing: partition_activations={bool(partition_activation)}", ranks=[0])


# ---------------------------------------------------------------------- checkpointing
def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them in backward.

    Tensor arguments (positional or keyword) receive gradients; non-tensor arguments are passed through. The
    recomputation replays the RNG state of the original call, so dropout (including dropout drawn inside
    ``get_cuda_rng_tracker().fork()``) gives the same masks. Returns exactly what ``function`` returns. Under
    ``torch.no_grad()`` the function is simply called.
    """
    return _core.checkpoint(function, args, kwargs)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Checkpoint ``function(*args)`` with non-reentrant autograd (works with ``torch.autograd.grad``).

    RNG state, including the tracker's streams, is replayed on recompute. Inputs are partitioned / offloaded as
    configured (never into the contiguous buffers). Keyword arguments are not accepted, as upstream.
    """
    return _core.non_reentrant_checkpoint(function, args)


# ---------------------------------------------------------------------- RNG
def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process-wide RNG stream tracker used by checkpointed model-parallel code."""
    return _core.current_state().tracker


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generator with ``seed`` and the model-parallel stream with ``seed + 2718 + tp_rank``.

    Call after :func:`configure` so the tensor-parallel rank is known (rank 0 without an mpu). Data-parallel
    ranks then draw identical default-stream numbers while tensor-parallel ranks draw distinct model-parallel
    ones.
    """
    _core.seed_model_parallel(_core.current_state(), seed)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Re-seed the model-parallel stream from ``seed`` (as :func:`model_parallel_cuda_manual_seed` would),
    leaving the default generator where it is."""
    _core.reseed_tensor_parallel(_core.current_state(), seed)


def detach_variable(inputs: tuple[Any, ...], device: torch.device | str | None = None) -> tuple[Any, ...]:
    """Detached copies of the tensors in ``inputs`` (moved to ``device`` if given), keeping ``requires_grad``."""
    out = []
    for item in inputs:
        if torch.is_tensor(item):
            item = (item.to(device) if device is not None else item).detach().requires_grad_(item.requires_grad)
        out.append(item)
    return tuple(out)
