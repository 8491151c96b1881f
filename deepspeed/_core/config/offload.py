"""``zero_optimization.offload_param`` and ``zero_optimization.offload_optimizer`` blocks (upstream keys)."""

from __future__ import annotations

import tempfile
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, model_validator

from deepspeed._core.config.base import DeepSpeedConfigModel, pp_int
from deepspeed._foundation.logging import logger


class OffloadDeviceEnum(str, Enum):
    """Where offloaded tensors live."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """Tensor classes that ``engine.offload_states`` can move off the accelerator."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


_NVME_ONLY_KEYS: tuple[str, ...] = ("nvme_path", "buffer_count", "pipeline_read", "pipeline_write")


class DeepSpeedZeroOffloadParamConfig(DeepSpeedConfigModel):
    """``offload_param``: keep ZeRO-3 parameter shards off the accelerator."""

    config_block: ClassVar[str] = "zero_optimization.offload_param"

    device: OffloadDeviceEnum = OffloadDeviceEnum.none
    """Target device: ``none`` (no offload), ``cpu`` or ``nvme``."""

    nvme_path: Path | None = None
    """Directory for the parameter swap files (``device: nvme`` at ZeRO-3; required then). It must exist and be
    writable; files go under ``<nvme_path>/zero_stage_3/<dtype>params/rank<r>/``."""

    buffer_count: int = Field(5, ge=0)
    """Pinned host buffers partitions are read into ahead of their gather (``device: nvme``; at least 1 is used)."""

    buffer_size: int = Field(pp_int(1e8), ge=0)
    """Elements of each of those buffers: the largest partition that can be swapped (``device: nvme``)."""

    max_in_cpu: int = Field(pp_int(1e9), ge=0)
    """Elements of partitions (the first ones partitioned) kept in host memory instead of swapped
    (``device: nvme``). Partitions under max(1 MiB, ``aio.block_size``) bytes always stay and do not count."""

    pin_memory: bool = True
    """Use page-locked host buffers (faster copies, more pinned RAM). Default true since upstream v0.19.5."""

    _nvme_keys_named = model_validator(mode="after")(
        lambda self: warn_nvme_keys_unused(self, ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu"))
    )


class DeepSpeedZeroOffloadOptimizerConfig(DeepSpeedConfigModel):
    """``offload_optimizer``: keep optimizer state (and the step) on CPU or NVMe."""

    config_block: ClassVar[str] = "zero_optimization.offload_optimizer"

    device: OffloadDeviceEnum = OffloadDeviceEnum.none
    """Target device: ``none`` (no offload), ``cpu`` or ``nvme``."""

    nvme_path: Path | None = None
    """Directory for the optimizer-state swap files (``device: nvme``; required then). It must exist and be
    writable; files go under ``<nvme_path>/zero_stage_3/optimizer/rank<r>/``."""

    buffer_count: int = Field(4, ge=0)
    """Host buffer sets (fp32 master and moments of one step chunk each) the NVMe swapper cycles through; reads run
    up to ``buffer_count - 1`` chunks ahead of the step with ``pipeline_read`` (``buffer_count - 2`` when
    ``pipeline_write`` is on too and there are three or more, so a chunk's write overlaps the next chunk's step)."""

    pin_memory: bool = True
    """Use page-locked host buffers. Default true since upstream v0.19.5. Gradient staging goes through a few fixed
    pinned slots at every stage, and write-backs through two pinned buffers. Masters and moments stay pageable at
    every stage (pinning a model-sized tensor through PyTorch's host allocator costs up to twice its size;
    docs/design/zero3.md, [Note: zero3-optimizer-offload]); upstream pins ZeRO-1/2's fp32 master partition. ZeRO-3
    also page-locks its host gradient chunks (power-of-two sized), which device copies write into directly."""

    pipeline_read: bool = False
    """Overlap NVMe reads of the next sub-group with the current optimizer step."""

    pipeline_write: bool = False
    """Overlap NVMe writes of the previous sub-group with the current optimizer step."""

    fast_init: bool = False
    """Upstream: initialise NVMe-offloaded optimizer state without a round-trip through swap files. No effect here:
    the initial state is written once, chunk by chunk."""

    ratio: float = Field(1.0, ge=0.0, le=1.0)
    """Upstream: fraction of optimizer state to offload (below 1.0 with ZeRO-3 only, still checked). No effect
    here: all of it is offloaded."""

    super_offload: bool = False
    """Upstream SuperOffload mode (accepted; not implemented by deepspeed-lean)."""

    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)
    """Share of CPU cores the CPU Adam step may use."""

    _nvme_path_usable = model_validator(mode="after")(lambda self: check_nvme_path(self))
    _nvme_keys_named = model_validator(mode="after")(lambda self: warn_nvme_keys_unused(self, _NVME_ONLY_KEYS))

    @property
    def pipeline(self) -> bool:
        """True when either NVMe read or write pipelining is on."""
        return self.pipeline_read or self.pipeline_write


_NVME_KEYS_WARNED: set[str] = set()  # once per message per process, as the surface's no-effect warnings


def warn_nvme_keys_unused(block: Any, keys: tuple[str, ...]) -> Any:
    """NVMe-only ``keys`` of an offload block given a non-default value while ``device`` is not ``nvme`` have
    no effect: say so instead of ignoring them."""
    if block.device == OffloadDeviceEnum.nvme:
        return block
    fields = type(block).model_fields
    unused = [
        f"{block.config_block}.{k}"
        for k in keys
        if k in block.model_fields_set and getattr(block, k) != fields[k].default
    ]
    message = (
        f"DeepSpeed config: {', '.join(unused)} only apply with {block.config_block}.device 'nvme' "
        f"(device is {OffloadDeviceEnum(block.device).value!r}); no effect"
    )
    if unused and message not in _NVME_KEYS_WARNED:
        _NVME_KEYS_WARNED.add(message)
        logger.warning(message)
    return block


def check_nvme_path(block: Any) -> Any:
    """An offload block with ``device: nvme`` needs an ``nvme_path`` that is an existing, writable directory
    (checked when the config is read, on every rank, before any collective)."""
    if block.device != OffloadDeviceEnum.nvme:
        return block
    key = f"{block.config_block}.nvme_path"
    path = block.nvme_path
    if path is None:
        raise ValueError(f"{key} is required with device 'nvme': give a directory on a local disk for swap files")
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise ValueError(f"{key}={str(path)!r} {what}; valid: an existing, writable directory")
    try:
        with tempfile.TemporaryFile(dir=path):
            pass  # a real write: permission bits alone miss read-only mounts and are bypassed by root
    except OSError as err:
        raise ValueError(
            f"{key}={str(path)!r} is not writable by this process ({err.strerror}); valid: an existing, writable "
            "directory"
        ) from None
    return block
