"""The small top-level blocks upstream reads key by key, and the optimizer-name and tag-validation constants.

``flops_profiler``, ``checkpoint``, ``optimizer``, ``scheduler`` are lenient (unknown keys warn);
``memory_timeline`` is a deepspeed-lean block and strict. The root model (``schema.py``) holds one field per block.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator

from deepspeed._core.config.base import DeepSpeedConfigModel, DeepSpeedLenientConfigModel


class ValidationMode:
    """Allowed values of ``checkpoint.tag_validation`` (compared case-insensitively)."""

    WARN = "WARN"
    IGNORE = "IGNORE"
    FAIL = "FAIL"


ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
DEEPSPEED_OPTIMIZERS = [
    ADAGRAD_OPTIMIZER,
    ADAM_OPTIMIZER,
    ADAMW_OPTIMIZER,
    LAMB_OPTIMIZER,
    ONEBIT_ADAM_OPTIMIZER,
    ONEBIT_LAMB_OPTIMIZER,
    ZERO_ONE_ADAM_OPTIMIZER,
    MUADAM_OPTIMIZER,
    MUADAMW_OPTIMIZER,
    MUSGD_OPTIMIZER,
    LION_OPTIMIZER,
    MUON_OPTIMIZER,
]
"""Optimizer ``type`` names DeepSpeed implements itself (compared lower-case); other names are ``torch.optim``."""

# --------------------------------------------------------------------------------------------------------------
# Blocks upstream reads key by key (unknown keys ignored with a warning).


class DeepSpeedFlopsProfilerConfig(DeepSpeedLenientConfigModel):
    """``flops_profiler`` block; enabling it also turns on ``wall_clock_breakdown``."""

    config_block: ClassVar[str] = "flops_profiler"

    enabled: bool = False
    """Profile one training step's FLOPs, latency and parameters."""
    recompute_fwd_factor: float = 0.0
    """Extra forward cost of activation recomputation, as a fraction of one forward."""
    profile_step: int = Field(1, ge=0)
    """Global step at which to profile."""
    module_depth: int = -1
    """Depth of the module tree to report (-1 = all)."""
    top_modules: int = 1
    """How many of the most expensive modules to list."""
    detailed: bool = True
    """Print the per-module breakdown."""
    output_file: str | None = None
    """Write the report here instead of stdout."""


class CheckpointParallelWriteConfig(DeepSpeedLenientConfigModel):
    """``checkpoint.parallel_write``."""

    config_block: ClassVar[str] = "checkpoint.parallel_write"

    pipeline_stage: bool = False
    """Pipeline runs: every stage writes its own layers in parallel."""


class CheckpointConfig(DeepSpeedLenientConfigModel):
    """``checkpoint`` block."""

    config_block: ClassVar[str] = "checkpoint"
    tolerated_keys: ClassVar[frozenset[str]] = frozenset({"writer"})

    tag_validation: str = ValidationMode.WARN
    """Check that all ranks save with the same tag: ``WARN``, ``IGNORE`` or ``FAIL`` (case-insensitive)."""
    load_universal: bool = False
    """Load a universal (world-size independent) checkpoint."""
    use_node_local_storage: bool = False
    """Each node writes to its own storage (local rank 0 of every node writes)."""
    parallel_write: CheckpointParallelWriteConfig = Field(default_factory=CheckpointParallelWriteConfig)
    """Parallel-write options."""
    checkpoint_serialization: bool = True
    """Serialize with ``torch.save`` (upstream switch; other writers are not implemented)."""

    @field_validator("tag_validation")
    @classmethod
    def _known_mode(cls, value: str) -> str:
        mode = str(value).upper()
        if mode not in (ValidationMode.WARN, ValidationMode.IGNORE, ValidationMode.FAIL):
            raise ValueError(f"must be one of WARN, IGNORE, FAIL; got {value!r}")
        return mode


class OptimizerBlockConfig(DeepSpeedLenientConfigModel):
    """``optimizer`` block: ``{"type": name, "params": {...}}``; params pass through to the optimizer."""

    config_block: ClassVar[str] = "optimizer"

    type: str | None = None
    """Optimizer name: a DeepSpeed optimizer (compared lower-case) or a ``torch.optim`` class name."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the optimizer constructor."""
    legacy_fusion: bool = False
    """Upstream legacy fused-optimizer switch (accepted; ignored)."""

    @field_validator("params")
    @classmethod
    def _no_max_grad_norm(cls, value: dict[str, Any]) -> dict[str, Any]:
        if "max_grad_norm" in value:
            raise ValueError(
                "'max_grad_norm' is not supported as an optimizer parameter; use the top-level "
                "'gradient_clipping' key instead"
            )
        return value


class SchedulerBlockConfig(DeepSpeedLenientConfigModel):
    """``scheduler`` block: ``{"type": name, "params": {...}}``."""

    config_block: ClassVar[str] = "scheduler"

    type: str | None = None
    """Scheduler name from ``deepspeed.runtime.lr_schedules`` or ``torch.optim.lr_scheduler``."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the scheduler constructor."""


class MemoryTimelineConfig(DeepSpeedConfigModel):
    """``memory_timeline`` block (a deepspeed-lean key): record one optimizer step's allocator history and write
    it with a per-category summary and chart (see docs/config.md)."""

    config_block: ClassVar[str] = "memory_timeline"

    enabled: bool = False
    """Record the allocator history of one optimizer step (CUDA only; elsewhere one warning, nothing recorded)."""
    step: int = Field(2, ge=1)
    """Global optimizer step to record, counting from 1: from its first micro-step through its optimizer step."""
    path: str = Field("memory_timeline", min_length=1)
    """Output prefix: every rank writes ``<path>_rank<r>.pickle``, ``.json`` and (with matplotlib) ``.png``."""
    max_entries: int = Field(1_000_000, ge=1)
    """Size of the allocator's history ring buffer; entries beyond it overwrite the oldest."""
