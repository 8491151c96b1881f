"""``zero_optimization`` block: upstream keys, aliases, defaults and deprecations, plus the lean switches.

``ZeroStageEnum`` pickles as ``deepspeed.runtime.zero.config.ZeroStageEnum`` (upstream checkpoints store it under
that path, optimizer-state key ``zero_stage``; the façade there re-exports it).
"""

from __future__ import annotations

import sys
from enum import IntEnum
from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from deepspeed._core.config.base import DeepSpeedConfigModel, pp_int
from deepspeed._core.config.offload import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
    check_nvme_path,
)
from deepspeed._core.config.plan import DEFAULT_LEAF_MODULE_CLASSES
from deepspeed._core.config.zenflow import ZenFlowConfig

ZERO_OPTIMIZATION = "zero_optimization"


class ZeroStageEnum(IntEnum):
    """ZeRO stages: what is partitioned across data-parallel ranks."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


# Pickles (optimizer-state key ``zero_stage``) name the class by upstream's path, which the façade re-exports, so
# that checkpoints load both here and in upstream DeepSpeed.
ZeroStageEnum.__module__ = "deepspeed.runtime.zero.config"


def _cpu_offload_optimizer(enabled: bool | None) -> dict | None:
    return {"device": OffloadDeviceEnum.cpu.value} if enabled else None


def _cpu_offload_param(enabled: bool | None) -> dict | None:
    return {"device": OffloadDeviceEnum.cpu.value} if enabled else None


class DeepSpeedZeroLeafModuleConfig(DeepSpeedConfigModel):
    """``zero_optimization.leaf_module``: modules ZeRO-3 treats as one unit (gathered/freed together).

    Matching rules: ``deepspeed/_core/params/leaf_policy.py``. Entries that match no module are logged and
    ignored, as upstream (whose default ``classes`` name Hugging Face MoE blocks most models lack).
    """

    config_block: ClassVar[str] = "zero_optimization.leaf_module"

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    """Class names of leaf modules, bare (``MyBlock``) or fully qualified (``my_pkg.layers.MyBlock``); a string
    matches the exact class, not subclasses. The default is upstream's (three Hugging Face sparse MoE blocks);
    giving ``classes`` replaces it."""

    names: list[str] = Field(default_factory=list)
    """Exact module names (as in ``named_modules()``; ``""`` is the root) of leaf modules."""

    name_suffixes: list[str] = Field(default_factory=list)
    """Module-name suffixes selecting leaf modules (plain string suffix of the qualified name)."""


class DeepSpeedZeroConfig(DeepSpeedConfigModel):
    """The ``zero_optimization`` block.

    ``"zero_optimization": true/false`` (legacy boolean form) means stage 1 / stage 0.
    """

    config_block: ClassVar[str] = ZERO_OPTIMIZATION

    stage: ZeroStageEnum = ZeroStageEnum.disabled
    """0 = off, 1 = partition optimizer states, 2 = + gradients, 3 = + parameters."""

    contiguous_gradients: bool = True
    """Upstream: copy gradients into a contiguous buffer as they are produced. No effect here: gradients always
    go to the flat reduction buckets."""

    reduce_scatter: bool = True
    """Reduce gradients with reduce-scatter to their owning rank (otherwise all-reduce)."""

    reduce_bucket_size: int = Field(pp_int(5e8), ge=0)
    """Elements reduced per gradient bucket."""

    use_multi_rank_bucket_allreduce: bool = True
    """Upstream: reduce a bucket holding gradients owned by several ranks with one all-reduce. No effect here:
    the bucket reduction strategy is fixed."""

    allgather_partitions: bool = True
    """ZeRO-1/2: all-gather updated partitions (otherwise broadcast each partition)."""

    allgather_bucket_size: int = Field(pp_int(5e8), ge=0)
    """Elements all-gathered at a time after the ZeRO-1/2 step; must be even for stages 1–2."""

    overlap_comm: bool | None = None
    """Overlap gradient reduction with backward; unset means true for stage 3, false otherwise."""

    load_from_fp32_weights: bool = True
    """On load, restore fp32 masters from the checkpoint's fp32 partitions (not from 16-bit weights)."""

    elastic_checkpoint: bool = False
    """Upstream: save ZeRO-1/2 optimizer state in a world-size-independent layout. No effect here: ZeRO-1/2
    checkpoints load at any data-parallel size regardless."""

    offload_param: DeepSpeedZeroOffloadParamConfig | None = None
    """Parameter offload (ZeRO-3); see ``offload_param`` keys."""

    offload_optimizer: DeepSpeedZeroOffloadOptimizerConfig | None = None
    """Optimizer-state offload; see ``offload_optimizer`` keys."""

    sub_group_size: int = Field(pp_int(1e9), ge=0)
    """Upstream: ZeRO-3 elements per optimizer sub-group stepped at a time. No effect here: the step is chunked
    by its own rule, a sixteenth of the master within 64-256 MiB (``deepspeed/_core/optim/chunked_step.py``)."""

    # Upstream's deprecation interface puts the converter function in json_schema_extra, typed by pydantic as JSON.
    cpu_offload_param: bool | None = Field(
        None,
        json_schema_extra={
            "deprecated": True,
            "new_param": "offload_param",
            "new_param_fn": _cpu_offload_param,  # type: ignore[dict-item]
        },
    )
    """Deprecated: ``true`` means ``offload_param: {device: cpu}``."""

    cpu_offload_use_pin_memory: bool | None = Field(
        None,
        json_schema_extra={
            "deprecated": True,
            "new_param": "offload_param or offload_optimizer",
            "set_new_param": False,
        },
    )
    """Deprecated: use ``pin_memory`` inside the offload blocks."""

    cpu_offload: bool | None = Field(
        None,
        json_schema_extra={
            "deprecated": True,
            "new_param": "offload_optimizer",
            "new_param_fn": _cpu_offload_optimizer,  # type: ignore[dict-item]  # as above
        },
    )
    """Deprecated: ``true`` means ``offload_optimizer: {device: cpu}``."""

    prefetch_bucket_size: int = Field(pp_int(5e7), ge=0, alias="stage3_prefetch_bucket_size")
    """ZeRO-3: elements of parameters prefetched ahead of use; 0 turns prefetching off. Units are gathered whole: at
    several ranks, when the next unit is a leaf (a repeated block, a ``leaf_module``) larger than the window, that
    one unit is prefetched whole."""

    param_persistence_threshold: int = Field(pp_int(1e5), ge=0, alias="stage3_param_persistence_threshold")
    """ZeRO-3: parameters with fewer elements stay gathered (not partitioned)."""

    model_persistence_threshold: int = Field(
        pp_int(sys.maxsize, "sys.maxsize"), ge=0, alias="stage3_model_persistence_threshold"
    )
    """ZeRO-3: cap on the total elements of persistent (unpartitioned) parameters."""

    max_live_parameters: int = Field(pp_int(1e9), ge=0, alias="stage3_max_live_parameters")
    """ZeRO-3: most parameter elements gathered at once before prefetching stops."""

    max_reuse_distance: int = Field(pp_int(1e9), ge=0, alias="stage3_max_reuse_distance")
    """ZeRO-3: keep a gathered parameter if it is used again within this many elements of the trace."""

    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    """ZeRO-3: gather full 16-bit weights for ``save_16bit_model`` / consolidated state dicts."""

    module_granularity_threshold: int = Field(pp_int(0), ge=0, alias="stage3_module_granularity_threshold")
    """ZeRO-3: a module whose granularity (parameter elements in its subtree / (1 + descendant modules)) is below
    this becomes a leaf module, fetched and released as one unit with its subtree, outermost first (0 = off).
    Childless modules and containers without ``forward`` are never selected; parameters count at full size, tied
    ones once. When nothing qualifies, a warning names the finest module and its granularity."""

    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    """ZeRO-3: gather parameters with all-reduce instead of all-gather."""

    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential")
    """ZeRO-3: gather parameters one at a time instead of coalesced."""

    stage3_gather_fp16_weights_on_model_save: bool = Field(
        False, json_schema_extra={"deprecated": True, "new_param": "gather_16bit_weights_on_model_save"}
    )
    """Deprecated spelling of ``gather_16bit_weights_on_model_save``."""

    ignore_unused_parameters: bool = True
    """Upstream: whether a parameter without a gradient in a step is an error. No effect here: it never is."""

    legacy_stage1: bool = False
    """Upstream legacy stage-1 implementation switch (accepted; ignored)."""

    round_robin_gradients: bool = False
    """Upstream: ZeRO-1/2 gradient copies ordered round-robin across ranks. No effect here: the copy order is
    fixed (same values)."""

    zero_hpz_partition_size: int = Field(1, ge=0)
    """ZeRO++ hierarchical partitioning group size (1 = off)."""

    zero_quantized_weights: bool = False
    """ZeRO++ quantized weight all-gather."""

    zero_quantized_nontrainable_weights: bool = False
    """ZeRO++ quantized storage of frozen weights."""

    zero_quantized_gradients: bool = False
    """ZeRO++ quantized gradient reduction."""

    zeropp_loco_param: dict[str, Any] | None = None
    """ZeRO++ LoCo error-feedback parameters."""

    mics_shard_size: int = -1
    """MiCS shard group size (-1 = off)."""

    mics_hierarchical_params_gather: bool = False
    """MiCS hierarchical parameter gather."""

    memory_efficient_linear: bool = True
    """ZeRO-3: use a linear layer that does not keep gathered weights alive for backward."""

    pipeline_loading_checkpoint: bool = False
    """Load checkpoints for pipeline-parallel ZeRO-3 runs layer by layer."""

    override_module_apply: bool = True
    """ZeRO-3 ``zero.Init``: gather parameters around ``Module.apply`` calls."""

    log_trace_cache_warnings: bool = False
    """ZeRO-3: log when the recorded prefetch trace is invalidated."""

    enable_sanity_checks: bool = False
    """Run extra (slow) consistency checks."""

    save_muon_momentum_buffer_in_memory: bool = False
    """Muon optimizer: keep the momentum buffer in memory (upstream switch)."""

    leaf_module: DeepSpeedZeroLeafModuleConfig = Field(default_factory=DeepSpeedZeroLeafModuleConfig)
    """ZeRO-3 leaf modules (fetched and released as one unit with their subtree, no hooks below), selected when the
    parameter manager starts, before hooks are installed; see ``zero_optimization.leaf_module``."""

    zenflow: ZenFlowConfig | None = None
    """ZenFlow: the important columns of each 2-D weight are updated every step, the rest of the gradients
    accumulate and are applied by the host optimizer every ``update_interval`` steps, optionally one step late
    (docs/offload.md). Stages 1 and 2 with ``offload_optimizer.device: "cpu"``."""

    lean_inplace_flatten: bool = True
    """deepspeed-lean: ZeRO-1/2 flatten parameters into their flat buffer on the accelerator, chunk by chunk,
    never through host memory; ZeRO-3 on one rank keeps a parameter that already lies on the accelerator in the
    working dtype in its own storage as its shard, instead of copying the model. ``false`` reproduces upstream's
    copy-through-CPU path and ZeRO-3's copy of every parameter (for A/B comparisons)."""

    lean_eager_grad_release: bool = True
    """deepspeed-lean: free each autograd ``.grad`` as soon as it is folded into its reduction bucket, instead of
    holding all gradients until the bucket flush. ``false`` reproduces upstream's retention (for A/B)."""

    lean_stream_ordered_release: bool = True
    """deepspeed-lean: ZeRO-3 frees gathered parameters on an event-ordered schedule rather than by marking
    them as used on a side stream, so freed memory is reusable immediately. ``false`` mimics upstream's late
    reuse (for A/B)."""

    lean_grads_in_param_shards: bool = True
    """deepspeed-lean: ZeRO-3 with ``offload_optimizer`` and one micro-step per window keeps each reduced gradient
    in its parameter's shard until the step (the shard is rewritten from the fp32 master then), instead of in
    host memory: 2 bytes per parameter less host memory. Any read of such a shard before the step gets the
    values back first. ``false`` keeps the gradient in host chunks (the upstream layout, for A/B)."""

    lean_gather_from_master: bool = True
    """deepspeed-lean: ZeRO-3 with the optimizer state on the accelerator (no ``offload_optimizer``, no
    ``offload_param``) keeps no separate 16-bit shard for the parameters the optimizer steps: each one's
    ``ds_tensor`` is its slice of the fp32 master, converted to the working dtype while it is copied into the
    all-gather buffer (the collective still carries 16 bits), and the step needs no write-back: 2 bytes per
    parameter less accelerator memory. Persistent and frozen parameters keep their own shard. No effect
    elsewhere. ``false`` keeps a 16-bit shard beside the master, rewritten after each step (upstream, for A/B)."""

    lean_block_fetch_units: bool = True
    """deepspeed-lean: ZeRO-3 fetches each repeated block of the model (every child of an ``nn.ModuleList`` that
    holds several modules of one class, such as a transformer's decoder layers, when it has at most
    ``stage3_max_live_parameters`` parameter elements) as one unit: one gather, one release and hooks only at
    the block's boundary, instead of one of each per submodule with parameters. Off while
    ``stage3_module_granularity_threshold`` is set; explicit ``leaf_module`` entries win. ``false`` fetches per
    submodule (upstream, for A/B)."""

    lean_unit_grad_reduce: bool = True
    """deepspeed-lean: ZeRO-3 over several ranks reduce-scatters each fetch unit's gradients together once the
    unit's backward is done (FSDP2's schedule: one collective per decoder layer under ``lean_block_fetch_units``),
    rather than in buckets of ``reduce_bucket_size`` elements; the reduced rows are laid out in shard order, so a
    unit's gradients fold into the gradient shard as one contiguous piece. The transient is one unit's gradients
    (already alive as autograd gradients) staged once. No effect on one rank, where nothing is reduced. ``false``
    buckets by ``reduce_bucket_size`` (upstream, for A/B)."""

    lean_pipeline_release: bool = True
    """deepspeed-lean: with pipeline parallelism, every stage frees a micro-batch's outputs and inputs as soon as its
    backward has run (and its input gradient is sent), so stage ``s`` of ``P`` holds at most ``min(P - s, G)``
    micro-batches of activations. ``false`` reproduces upstream's behaviour (for A/B): the last stage keeps every
    micro-batch's outputs until the step ends, growing with ``gradient_accumulation_steps``."""

    lean_overlap_offload_step: bool = True
    """deepspeed-lean: with ``offload_optimizer``, a host worker thread steps the optimizer chunk by chunk while the
    training thread converts each stepped chunk to the working dtype and copies it up without blocking, through two
    reused page-locked buffers; the copies of one chunk run while the next is stepped. The result is bit-identical
    to the synchronous order. ``false`` steps every chunk, then writes the weights back (for A/B)."""

    lean_short_switch_interval: bool = True
    """deepspeed-lean: while the host worker of ``lean_overlap_offload_step`` has chunks to step, Python's thread
    switch interval is 0.5 ms instead of its default 5 ms (restored afterwards), so the worker gets the interpreter
    back after each chunk without waiting out the training thread's time slice, and the training thread is not held
    up by the worker either. ``false`` leaves the interval alone (for A/B)."""

    @field_validator("stage", mode="before")
    @classmethod
    def _stage_in_range(cls, value: Any) -> Any:
        # Checked here so the message lists the stages once (the enum has an alias for 3).
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, bool) or value not in (0, 1, 2, 3):
            raise ValueError(f"must be one of 0, 1, 2, 3; got {value!r}")
        return value

    @model_validator(mode="after")
    def _resolve_and_check(self) -> DeepSpeedZeroConfig:
        # Assign through __dict__: validate_assignment would otherwise re-enter this validator.
        if self.overlap_comm is None:
            self.__dict__["overlap_comm"] = self.stage == ZeroStageEnum.weights
        if self.offload_optimizer is not None and self.offload_optimizer.ratio < 1.0 and self.stage != 3:
            raise ValueError(
                f"offload_optimizer.ratio < 1.0 (got {self.offload_optimizer.ratio}) is supported "
                f"only with stage 3; stage is {self.stage}"
            )
        if self.stage == 3 and self.offload_param is not None:
            check_nvme_path(self.offload_param)  # stages 0-2 ignore offload_param, as upstream does
        if self.zenflow is not None:
            _check_zenflow(self)
        if self.stage in (1, 2) and self.allgather_bucket_size % 2:
            raise ValueError(f"allgather_bucket_size must be even for stages 1 and 2; got {self.allgather_bucket_size}")
        return self


def _check_zenflow(zero: DeepSpeedZeroConfig) -> None:
    """``zenflow`` runs at stages 1 and 2 with the optimizer offloaded to the cpu."""
    if zero.stage == 3:
        raise ValueError(
            "zenflow is implemented at stages 1 and 2 only; stage is 3 (remove the zenflow block or use stage 1 or 2)"
        )
    if zero.stage == 0:
        raise ValueError("zenflow needs ZeRO stage 1 or 2 with offload_optimizer; stage is 0")
    device = zero.offload_optimizer.device if zero.offload_optimizer is not None else OffloadDeviceEnum.none
    if device != OffloadDeviceEnum.cpu:
        raise ValueError(f"zenflow needs offload_optimizer.device 'cpu'; got {getattr(device, 'value', device)!r}")


def read_zero_config_deprecated(param_dict: dict) -> dict:
    """Translate the legacy ``"zero_optimization": true/false`` form into a block dict."""
    legacy = param_dict[ZERO_OPTIMIZATION]
    return {"stage": 1 if legacy else 0}


def get_zero_config(param_dict: dict) -> DeepSpeedZeroConfig:
    """Build the ``zero_optimization`` block from a whole DeepSpeed config dict."""
    block = param_dict.get(ZERO_OPTIMIZATION, {})
    if isinstance(block, bool):
        block = read_zero_config_deprecated(param_dict)
    return DeepSpeedZeroConfig(**block)
