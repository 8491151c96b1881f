"""The batch-size triangle: ``train_batch_size = micro batch * accumulation steps * data-parallel size``.

Any two corners determine the third; :func:`resolve_batch` fills it in and :func:`check_batch` checks the invariant
(also after the engine's batch-size setters change a corner).
"""

from __future__ import annotations

import os
from typing import Any

from deepspeed._core.config.base import DeepSpeedConfigError
from deepspeed._core.config.plan import BatchPlan

__all__ = ["data_parallel_world_size", "resolve_batch", "check_batch"]


def data_parallel_world_size(mpu: Any = None, mesh_device: Any = None, sequence_parallel_size: int = 1) -> int:
    """Data-parallel world size used by the batch triangle.

    Order: ``mpu.get_data_parallel_world_size()``; else ``deepspeed.comm`` (the mesh's data-parallel group when a
    mesh is given) if it is initialised; else env ``WORLD_SIZE``; else 1. Without an mpu or mesh the size is
    divided by ``sequence_parallel_size``; a sequence-parallel mpu (no data-parallel queries) divides it by its
    own sequence-parallel size.
    """
    if mpu is not None and hasattr(mpu, "get_data_parallel_world_size"):
        return int(mpu.get_data_parallel_world_size())
    if mpu is not None and hasattr(mpu, "get_sequence_parallel_world_size"):
        sequence_parallel_size = int(mpu.get_sequence_parallel_world_size())
    world = _comm_world_size(mesh_device)
    if world is None:
        raw = os.environ.get("WORLD_SIZE", "1")
        if not raw.strip().isdigit() or int(raw) < 1:
            raise DeepSpeedConfigError(f"environment variable WORLD_SIZE must be a positive integer; got {raw!r}")
        world = int(raw)
    if mesh_device is None and sequence_parallel_size > 1:
        if world % sequence_parallel_size:
            raise DeepSpeedConfigError(
                f"sequence_parallel_size ({sequence_parallel_size}) must divide the world size ({world})"
            )
        world //= sequence_parallel_size
    return world


def _comm_world_size(mesh_device: Any) -> int | None:
    # Imported lazily: deepspeed.comm imports config-adjacent modules, and this layer must work (on env
    # WORLD_SIZE) before or without an initialised process group.
    try:
        from deepspeed._core.comm import dist
    except ImportError:
        return None
    is_initialized = getattr(dist, "is_initialized", None)
    get_world_size = getattr(dist, "get_world_size", None)
    if not callable(is_initialized) or not callable(get_world_size) or not is_initialized():
        return None
    if mesh_device is not None:
        return int(get_world_size(mesh_device.get_group(mesh_dim="data_parallel")))
    return int(get_world_size())


def resolve_batch(
    train_batch_size: int | None, micro_batch: int | None, grad_acc: int | None, world_size: int
) -> BatchPlan:
    """Fill in the missing corner of the batch triangle and check it.

    Any two of ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps``
    determine the third; one alone implies ``gradient_accumulation_steps = 1``.

    Raises:
        DeepSpeedConfigError: neither batch size is given, a value is not positive, or
            ``train_batch_size != micro * accumulation * world_size``.
    """
    for key, value in (
        ("train_batch_size", train_batch_size),
        ("train_micro_batch_size_per_gpu", micro_batch),
        ("gradient_accumulation_steps", grad_acc),
    ):
        if value is not None and value <= 0:
            raise DeepSpeedConfigError(f"{key}: {value} has to be greater than 0")
    derived = sum(value is None for value in (train_batch_size, micro_batch, grad_acc)) > 0
    if train_batch_size is not None and micro_batch is not None and grad_acc is None:
        grad_acc = train_batch_size // micro_batch // world_size
    elif train_batch_size is not None and grad_acc is not None and micro_batch is None:
        micro_batch = train_batch_size // world_size // grad_acc
    elif micro_batch is not None and grad_acc is not None and train_batch_size is None:
        train_batch_size = micro_batch * grad_acc * world_size
    elif train_batch_size is not None and micro_batch is None and grad_acc is None:
        grad_acc, micro_batch = 1, train_batch_size // world_size
    elif micro_batch is not None and train_batch_size is None and grad_acc is None:
        grad_acc, train_batch_size = 1, micro_batch * world_size
    elif train_batch_size is None and micro_batch is None:
        raise DeepSpeedConfigError("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")
    # Every branch above either raised or left all three set (all three given takes no branch).
    assert train_batch_size is not None and micro_batch is not None and grad_acc is not None
    plan = BatchPlan(train_batch_size, micro_batch, grad_acc, world_size)
    check_batch(plan, derived)
    return plan


def check_batch(plan: BatchPlan, derived: bool = False) -> None:
    """Raise :class:`DeepSpeedConfigError` unless ``plan`` satisfies the batch-size invariant."""
    product = plan.micro_batch_per_gpu * plan.gradient_accumulation_steps * plan.dp_world_size
    if plan.train_batch_size == product and product > 0:
        return
    hint = " (a value was derived from the others; they do not divide evenly)" if derived else ""
    raise DeepSpeedConfigError(
        "Check batch related parameters: train_batch_size must equal train_micro_batch_size_per_gpu * "
        "gradient_accumulation_steps * data-parallel world size, but "
        f"{plan.train_batch_size} != {plan.micro_batch_per_gpu} * {plan.gradient_accumulation_steps} * "
        f"{plan.dp_world_size}{hint}"
    )
