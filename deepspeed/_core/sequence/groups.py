"""Sequence-parallel process groups: who shares one sequence, and who ZeRO shards and reduces over.

Ranks are laid out in contiguous blocks of ``sp`` (``[i*sp, (i+1)*sp)`` is one sequence-parallel group: its ranks
hold one sample's sequence shards). The sequence-data-parallel group is every rank: the ranks of an SP group hold the
same (replicated) parameters, so ZeRO may shard over all of them, and averaging gradients over all of them is the
exact mean when each rank's loss is the mean loss of its sample (see docs/long_context.md, "Gradients under SP").

The module state is process-wide, as upstream's ``parallel_state_sp``: one SP layout per process.
"""

from __future__ import annotations

from typing import Any

from deepspeed._core.comm import dist

_SEQUENCE_PARALLEL_GROUP: Any = None
_SEQUENCE_DATA_PARALLEL_GROUP: Any = None
_SEQUENCE_PARALLEL_SIZE: int | None = None


def sequence_parallel_problem(sequence_parallel_size: Any, world_size: int) -> str | None:
    """Why ``sequence_parallel_size`` cannot be used at ``world_size`` (``None`` when it can).

    Purely local: every rank reaches the same verdict without communicating.
    """
    if isinstance(sequence_parallel_size, bool) or not isinstance(sequence_parallel_size, int):
        return f"sequence_parallel_size must be an int; got {sequence_parallel_size!r}"
    if sequence_parallel_size < 1:
        return f"sequence_parallel_size must be at least 1; got {sequence_parallel_size}"
    if world_size % sequence_parallel_size or world_size < sequence_parallel_size:
        valid = [d for d in range(2, world_size + 1) if world_size % d == 0]
        return (
            f"sequence_parallel_size={sequence_parallel_size} must divide the world size {world_size} "
            f"(valid sizes here: {valid})"
        )
    return None


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Create the sequence-parallel groups (collective: every rank calls it with the same size).

    Raises:
        RuntimeError: ``sequence_parallel_size`` does not divide the world size (raised before any group is made).
        ValueError: ``sequence_parallel_size`` is not greater than 1.
        AssertionError: no process group, or the groups exist already.
    """
    global _SEQUENCE_PARALLEL_GROUP, _SEQUENCE_DATA_PARALLEL_GROUP, _SEQUENCE_PARALLEL_SIZE
    assert dist.is_initialized(), "initialize_sequence_parallel needs an initialized process group"
    assert _SEQUENCE_PARALLEL_GROUP is None, "sequence parallel groups are already initialized"
    world = dist.get_world_size()
    if isinstance(sequence_parallel_size, int) and sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1; got {sequence_parallel_size}")
    problem = sequence_parallel_problem(sequence_parallel_size, world)
    if problem is not None:
        raise RuntimeError(problem)
    rank = dist.get_rank()
    # new_group is collective over the world: every rank creates every group and keeps its own.
    for start in range(0, world, sequence_parallel_size):
        ranks = list(range(start, start + sequence_parallel_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            _SEQUENCE_PARALLEL_GROUP = group
    _SEQUENCE_DATA_PARALLEL_GROUP = dist.new_group(list(range(world)))
    _SEQUENCE_PARALLEL_SIZE = sequence_parallel_size


def ensure_sequence_parallel(sequence_parallel_size: int, asked_by: str) -> None:
    """Create the groups of ``sequence_parallel_size`` unless they exist (collective when it creates them).

    Raises:
        RuntimeError: groups of another size exist already; ``asked_by`` names what asked for this size.
    """
    if not is_initialized():
        initialize_sequence_parallel(sequence_parallel_size)
    elif get_sequence_parallel_world_size() != sequence_parallel_size:
        raise RuntimeError(
            f"sequence parallel groups of size {get_sequence_parallel_world_size()} exist already, but {asked_by} "
            f"asks for sequence_parallel_size={sequence_parallel_size}"
        )


def is_initialized() -> bool:
    """Whether :func:`initialize_sequence_parallel` has run (and not been released)."""
    return _SEQUENCE_PARALLEL_GROUP is not None


def _require(group: Any) -> Any:
    assert group is not None, "sequence parallel groups are not initialized (call initialize_sequence_parallel)"
    return group


def get_sequence_parallel_group() -> Any:
    """The group of ranks holding shards of the same sequences."""
    return _require(_SEQUENCE_PARALLEL_GROUP)


def get_sequence_parallel_world_size() -> int:
    """Size of this rank's sequence-parallel group."""
    return dist.get_world_size(group=get_sequence_parallel_group())


def get_sequence_parallel_rank() -> int:
    """This rank's index in its sequence-parallel group (which shard of the sequence it holds)."""
    return dist.get_rank(group=get_sequence_parallel_group())


def get_sequence_data_parallel_group() -> Any:
    """The group ZeRO shards over and gradients are averaged in: every rank."""
    return _require(_SEQUENCE_DATA_PARALLEL_GROUP)


def get_sequence_data_parallel_world_size() -> int:
    """Size of the sequence-data-parallel group (the world)."""
    return dist.get_world_size(group=get_sequence_data_parallel_group())


def get_sequence_data_parallel_rank() -> int:
    """This rank's index in the sequence-data-parallel group."""
    return dist.get_rank(group=get_sequence_data_parallel_group())


def data_parallel_world_size() -> int:
    """How many different batches are trained at once: world / SP size."""
    return dist.get_world_size() // get_sequence_parallel_world_size()


def data_parallel_rank() -> int:
    """Which of those batches this rank's SP group trains on (its SP group's index)."""
    return dist.get_rank() // get_sequence_parallel_world_size()


def release_sequence_parallel_groups() -> None:
    """Forget the groups (they stay alive in the backend), so that a later initialize may build new ones."""
    global _SEQUENCE_PARALLEL_GROUP, _SEQUENCE_DATA_PARALLEL_GROUP, _SEQUENCE_PARALLEL_SIZE
    _SEQUENCE_PARALLEL_GROUP = None
    _SEQUENCE_DATA_PARALLEL_GROUP = None
    _SEQUENCE_PARALLEL_SIZE = None


# Upstream's SP mpu answers the model-parallel queries with its sequence-parallel group; the engine recognises
# the module (it has initialize_sequence_parallel) and treats it as no model parallelism.
get_model_parallel_group = get_sequence_parallel_group
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_rank = get_sequence_parallel_rank
_release_sequence_parallel_groups = release_sequence_parallel_groups


def is_sequence_parallel_unit(unit: Any) -> bool:
    """Whether ``unit`` (an ``mpu``) is a sequence-parallel unit such as this module."""
    return (
        unit is not None
        and hasattr(unit, "initialize_sequence_parallel")
        and not hasattr(unit, "get_data_parallel_group")
    )
