"""Process-group registry that ZeRO, MoE and integrations query (``deepspeed.utils.groups``).

Lookup order for every "which group am I in" question: a device mesh built by ``initialize(mesh_param=...)``
(``mesh_device``), then a registered model-parallel unit (``mpu``, Megatron-style object), then plain data
parallelism over the whole world. Without sequence parallelism the SP world size is 1 and the SP rank 0; asking for
the SP *group* raises ``KeyError`` as upstream does (returning ``None`` would silently mean "the world group").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepspeed._core.comm import dist
from deepspeed.utils.logging import log_dist

# Megatron-style model-parallel unit registered by deepspeed.initialize(mpu=...) (upstream attribute name).
mpu: Any = None
# torch DeviceMesh with "data_parallel"/"sequence_parallel" dims, when one was built.
mesh_device: Any = None
# Tensor-parallel size of expert layers (read by MoE code).
expert_tensor_parallel_world_size = 1

_WORLD_GROUP: Any = None
_EXPERT_PARALLEL_GROUP: dict[str, Any] = {}
_EXPERT_PARALLEL_GROUP_RANKS: dict[str, list[int]] = {}
_EXPERT_DATA_PARALLEL_GROUP: dict[str, Any] = {}
_EXPERT_DATA_PARALLEL_GROUP_RANKS: dict[str, list[int]] = {}
_TENSOR_MODEL_PARALLEL_GROUP: Any = None
_MODEL_PARALLEL_GROUP: Any = None
_DATA_PARALLEL_GROUP: Any = None
_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE: int | None = None
_MPU_TENSOR_MODEL_PARALLEL_RANK: int | None = None

_NOT_INIT = "dist is not initialized"


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    """Register ``mpu`` (may be ``None``) and, when ``ep_size > 1``, build expert-parallel groups of that size."""
    # The parameter shadows the module attribute of the same (upstream) name, hence globals().
    globals()["mpu"] = mpu
    if ep_size > 1:
        _create_expert_and_data_parallel(ep_size)


def _ensure_divisibility(numerator: int, denominator: int) -> None:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"


def _is_sequence_parallel_mpu(unit: Any) -> bool:
    # Ulysses-style SP units replace data-parallel queries with their own sequence-data-parallel ones.
    return unit is not None and hasattr(unit, "initialize_sequence_parallel")


# ---------------------------------------------------------------------- world / data parallel
def _clone_world_group() -> Any:
    """A subgroup containing every rank (cached); unlike the default group it works with ``get_global_rank``."""
    assert dist.is_initialized(), _NOT_INIT
    global _WORLD_GROUP
    if _WORLD_GROUP is None:
        _WORLD_GROUP = dist.new_group(ranks=range(dist.get_world_size()))
    return _WORLD_GROUP


def _get_data_parallel_group() -> Any:
    """Data-parallel group of this rank (mesh, then mpu, then a clone of the world group)."""
    assert dist.is_initialized(), _NOT_INIT
    if mesh_device is not None:
        return mesh_device.get_group(mesh_dim="data_parallel")
    if mpu is not None:
        return None if _is_sequence_parallel_mpu(mpu) else mpu.get_data_parallel_group()
    return _clone_world_group()


def _get_data_parallel_group_ranks() -> Sequence[int]:
    """Global ranks of this rank's data-parallel group."""
    assert dist.is_initialized(), _NOT_INIT
    if mpu is not None and hasattr(mpu, "get_data_parallel_group_ranks"):
        return mpu.get_data_parallel_group_ranks()
    return range(dist.get_world_size())


def _get_data_parallel_world_size() -> int | None:
    """Size of this rank's data-parallel group (``None`` for an SP unit, which has no plain DP group)."""
    assert dist.is_initialized(), _NOT_INIT
    if mesh_device is not None:
        return dist.get_world_size(mesh_device.get_group(mesh_dim="data_parallel"))
    if mpu is not None:
        return None if _is_sequence_parallel_mpu(mpu) else mpu.get_data_parallel_world_size()
    return dist.get_world_size(group=_get_data_parallel_group())


def _get_data_parallel_rank() -> int:
    """This rank's index in its data-parallel group."""
    assert dist.is_initialized(), _NOT_INIT
    if mpu is not None and not _is_sequence_parallel_mpu(mpu) and hasattr(mpu, "get_data_parallel_rank"):
        return mpu.get_data_parallel_rank()
    return dist.get_rank(group=_get_data_parallel_group())


def _get_broadcast_src_rank() -> int:
    """Global rank that broadcasts initial weights within this rank's (sequence-)data-parallel group."""
    assert dist.is_initialized(), _NOT_INIT
    return dist.get_global_rank(_get_sequence_data_parallel_group(), 0)


# ---------------------------------------------------------------------- model / tensor parallel
def _get_model_parallel_world_size() -> int:
    """Model-parallel size from the registered mpu (1 without one)."""
    if mpu is None or _is_sequence_parallel_mpu(mpu):
        return 1
    return mpu.get_model_parallel_world_size()


def get_tensor_model_parallel_group() -> Any:
    """Tensor-parallel group of this rank (the mpu's when registered)."""
    if mpu is not None and hasattr(mpu, "get_tensor_model_parallel_group"):
        return mpu.get_tensor_model_parallel_group()
    assert _TENSOR_MODEL_PARALLEL_GROUP is not None, "intra_layer_model parallel group is not initialized"
    return _TENSOR_MODEL_PARALLEL_GROUP


def get_model_parallel_group() -> Any:
    """Model-parallel group of this rank."""
    if mpu is not None and hasattr(mpu, "get_model_parallel_group"):
        return mpu.get_model_parallel_group()
    assert _MODEL_PARALLEL_GROUP is not None, "model parallel group is not initialized"
    return _MODEL_PARALLEL_GROUP


def get_data_parallel_group() -> Any:
    """Data-parallel group of this rank (same lookup as :func:`_get_data_parallel_group`)."""
    return _DATA_PARALLEL_GROUP if _DATA_PARALLEL_GROUP is not None else _get_data_parallel_group()


def set_tensor_model_parallel_world_size(world_size: int) -> None:
    """Override the reported tensor-parallel size."""
    global _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE
    _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = world_size


def set_tensor_model_parallel_rank(rank: int) -> None:
    """Override the reported tensor-parallel rank."""
    global _MPU_TENSOR_MODEL_PARALLEL_RANK
    _MPU_TENSOR_MODEL_PARALLEL_RANK = rank


def get_tensor_model_parallel_world_size() -> int:
    """Tensor-parallel size: override, then mpu, then the TP group; 1 when there is no tensor parallelism."""
    if _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE is not None:
        return _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE
    if mpu is not None and hasattr(mpu, "get_tensor_model_parallel_world_size"):
        return mpu.get_tensor_model_parallel_world_size()
    if _TENSOR_MODEL_PARALLEL_GROUP is None:
        return 1
    return dist.get_world_size(group=_TENSOR_MODEL_PARALLEL_GROUP)


def get_tensor_model_parallel_rank() -> int:
    """Tensor-parallel rank: override, then mpu, then the TP group; 0 when there is no tensor parallelism."""
    if _MPU_TENSOR_MODEL_PARALLEL_RANK is not None:
        return _MPU_TENSOR_MODEL_PARALLEL_RANK
    if mpu is not None and hasattr(mpu, "get_tensor_model_parallel_rank"):
        return mpu.get_tensor_model_parallel_rank()
    if _TENSOR_MODEL_PARALLEL_GROUP is None:
        return 0
    return dist.get_rank(group=_TENSOR_MODEL_PARALLEL_GROUP)


def get_model_parallel_world_size() -> int:
    """Alias of :func:`get_tensor_model_parallel_world_size`."""
    return get_tensor_model_parallel_world_size()


def get_model_parallel_rank() -> int:
    """Alias of :func:`get_tensor_model_parallel_rank`."""
    return get_tensor_model_parallel_rank()


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 in this rank's TP group (TP groups are contiguous)."""
    size = get_tensor_model_parallel_world_size()
    return (dist.get_rank() // size) * size


def get_data_parallel_world_size() -> int:
    """Size of this rank's data-parallel group."""
    return dist.get_world_size(group=get_data_parallel_group())


def get_data_parallel_rank() -> int:
    """This rank's index in its data-parallel group."""
    return dist.get_rank(group=get_data_parallel_group())


# ---------------------------------------------------------------------- sequence parallel
def _get_sequence_parallel_world_size() -> int:
    """Sequence-parallel size (1 without sequence parallelism)."""
    assert dist.is_initialized(), _NOT_INIT
    if mesh_device is not None:
        return dist.get_world_size(mesh_device.get_group(mesh_dim="sequence_parallel"))
    if mpu is not None and hasattr(mpu, "get_sequence_parallel_world_size"):
        return mpu.get_sequence_parallel_world_size()
    return 1


def _get_sequence_parallel_rank() -> int:
    """Sequence-parallel rank (0 without sequence parallelism)."""
    if mpu is not None and hasattr(mpu, "get_sequence_parallel_rank"):
        return mpu.get_sequence_parallel_rank()
    if mesh_device is not None:
        return dist.get_rank(mesh_device.get_group(mesh_dim="sequence_parallel"))
    return 0


def _get_sequence_parallel_group() -> Any:
    """Sequence-parallel group; ``KeyError`` when sequence parallelism is not set up."""
    if mpu is not None and hasattr(mpu, "get_sequence_parallel_group"):
        return mpu.get_sequence_parallel_group()
    if mesh_device is not None:
        return mesh_device.get_group(mesh_dim="sequence_parallel")
    raise KeyError("No sequence parallel group found")


def _get_sequence_data_parallel_world_size() -> int | None:
    """Size of the combined sequence x data parallel group ZeRO shards over (``None`` as for the DP size)."""
    if mpu is not None and hasattr(mpu, "get_sequence_data_parallel_world_size"):
        return mpu.get_sequence_data_parallel_world_size()
    return _get_data_parallel_world_size()


def _get_sequence_data_parallel_rank() -> int:
    """Rank in the combined sequence x data parallel group."""
    if mpu is not None and hasattr(mpu, "get_sequence_data_parallel_rank"):
        return mpu.get_sequence_data_parallel_rank()
    return _get_data_parallel_rank()


def _get_sequence_data_parallel_group() -> Any:
    """The group ZeRO partitions over and reduces gradients in (sequence x data parallel)."""
    if mpu is not None and hasattr(mpu, "get_sequence_data_parallel_group"):
        return mpu.get_sequence_data_parallel_group()
    return _get_data_parallel_group()


# ---------------------------------------------------------------------- expert parallel
def _create_expert_and_data_parallel(
    expert_parallel_size_: int, use_data_before_expert_parallel_: bool = False
) -> None:
    """Build expert-parallel groups of ``expert_parallel_size_`` consecutive ranks plus their expert-data groups.

    With ``use_data_before_expert_parallel_`` the roles of the two strides are swapped (data-major layout).
    Idempotent per size; every rank must call it (group creation is collective).
    """
    assert dist.is_initialized(), _NOT_INIT
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if expert_parallel_size_ < 1 or world_size % expert_parallel_size_ != 0:
        # Raised identically on every rank before any group is created, so no rank waits in new_group.
        raise ValueError(
            f"expert-parallel size ep_size={expert_parallel_size_} must divide the world size {world_size} "
            f"(valid ep_size values here: {[d for d in range(1, world_size + 1) if world_size % d == 0]})"
        )
    name = f"ep_size_{expert_parallel_size_}"
    if name in _EXPERT_PARALLEL_GROUP:
        return
    log_dist(f"Creating expert and data parallel groups with size {expert_parallel_size_}", ranks=[0])
    n_blocks = world_size // expert_parallel_size_
    blocks = [list(range(i * expert_parallel_size_, (i + 1) * expert_parallel_size_)) for i in range(n_blocks)]
    strided = [list(range(i, world_size, expert_parallel_size_)) for i in range(expert_parallel_size_)]
    if use_data_before_expert_parallel_:
        ep_groups = [list(range(i, world_size, n_blocks)) for i in range(n_blocks)]
        edp_groups = [list(range(i * n_blocks, (i + 1) * n_blocks)) for i in range(expert_parallel_size_)]
    else:
        ep_groups, edp_groups = blocks, strided
    # new_group is collective over the world: every rank creates every group, keeping only its own.
    for ranks in edp_groups:
        group = dist.new_group(ranks)
        _register(group, ranks, rank, name, _EXPERT_DATA_PARALLEL_GROUP, _EXPERT_DATA_PARALLEL_GROUP_RANKS)
    for ranks in ep_groups:
        _register(dist.new_group(ranks), ranks, rank, name, _EXPERT_PARALLEL_GROUP, _EXPERT_PARALLEL_GROUP_RANKS)


def _register(
    group: Any, ranks: list[int], rank: int, name: str, groups: dict[str, Any], ranks_by_name: dict[str, list[int]]
) -> None:
    if rank in ranks:
        groups[name] = group
        ranks_by_name[name] = ranks


def _get_max_expert_size() -> int | None:
    """Largest expert-parallel size among the created groups."""
    sizes = [int(name.split("_")[2]) for name in _EXPERT_PARALLEL_GROUP]
    return max(sizes) if sizes else None


def _get_max_expert_size_name() -> str:
    """Group name of the largest expert-parallel size."""
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group() -> Any:
    """Expert-parallel group of the largest size."""
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_parallel_group(group_name: str) -> Any:
    """Expert-parallel group ``group_name`` of this rank."""
    assert group_name in _EXPERT_PARALLEL_GROUP, "expert parallel group is not initialized"
    return _EXPERT_PARALLEL_GROUP[group_name]


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    """All expert-parallel groups of this rank by name."""
    return _EXPERT_PARALLEL_GROUP


def _get_expert_data_parallel_group(group_name: str) -> Any:
    """Expert-data-parallel group ``group_name`` of this rank."""
    assert group_name in _EXPERT_DATA_PARALLEL_GROUP, "expert data parallel group is not initialized"
    return _EXPERT_DATA_PARALLEL_GROUP[group_name]


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    """All expert-data-parallel groups of this rank by name."""
    return _EXPERT_DATA_PARALLEL_GROUP


def _get_expert_parallel_world_size(group_name: str) -> int:
    """Size of expert-parallel group ``group_name``."""
    return dist.get_world_size(group=_get_expert_parallel_group(group_name))


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    """Size of expert-data-parallel group ``group_name``."""
    return dist.get_world_size(group=_get_expert_data_parallel_group(group_name))


def _get_expert_parallel_rank(group_name: str) -> int:
    """This rank's index in expert-parallel group ``group_name``."""
    return dist.get_rank(group=_get_expert_parallel_group(group_name))


def _get_expert_data_parallel_rank(group_name: str) -> int:
    """This rank's index in expert-data-parallel group ``group_name``."""
    return dist.get_rank(group=_get_expert_data_parallel_group(group_name))


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """Global rank that broadcasts expert weights within expert-data-parallel group ``group_name``."""
    return dist.get_global_rank(_get_expert_data_parallel_group(group_name), 0)


def _get_expert_model_parallel_world_size() -> int:
    """Tensor-parallel size of expert layers."""
    return expert_tensor_parallel_world_size
