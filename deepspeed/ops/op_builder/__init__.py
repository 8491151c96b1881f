"""Op builders under upstream's names.

Upstream re-exports each builder as a closure that asks the current accelerator for its class;
deepspeed-lean has one builder per op (CUDA or CPU decided by what is installed), so the classes
themselves are exported. ``get_default_compute_capabilities`` is not provided.
"""

from __future__ import annotations

from deepspeed.ops.op_builder.all_ops import ALL_OPS, NATIVE_BUILDERS
from deepspeed.ops.op_builder.async_io import AsyncIOBuilder
from deepspeed.ops.op_builder.builder import (
    CUDAOpBuilder,
    OpBuilder,
    OpStatus,
    csrc_root,
)
from deepspeed.ops.op_builder.cpu_adam import CPUAdamBuilder
from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder
from deepspeed.ops.op_builder.unsupported import STUB_BUILDERS, NotImplementedBuilder
from deepspeed.ops.op_builder.utils import UtilsBuilder

# The stub classes (CPUAdagradBuilder, FusedLambBuilder, ...) become module attributes here.
globals().update(STUB_BUILDERS)

__all__ = [
    "ALL_OPS",
    "NATIVE_BUILDERS",
    "AsyncIOBuilder",
    "CPUAdagradBuilder",
    "CPUAdamBuilder",
    "CPULionBuilder",
    "CUDAOpBuilder",
    "EvoformerAttnBuilder",
    "FPQuantizerBuilder",
    "FusedAdamBuilder",
    "FusedLambBuilder",
    "FusedLionBuilder",
    "GDSBuilder",
    "InferenceBuilder",
    "NotImplementedBuilder",
    "OpBuilder",
    "OpStatus",
    "QuantizerBuilder",
    "RaggedOpsBuilder",
    "RaggedUtilsBuilder",
    "RandomLTDBuilder",
    "TransformerBuilder",
    "UtilsBuilder",
    "csrc_root",
]
