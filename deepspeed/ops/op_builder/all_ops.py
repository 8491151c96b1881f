"""``ALL_OPS``: every named op builder, keyed by op ``NAME`` (upstream's registry shape)."""

from __future__ import annotations

from deepspeed.ops.op_builder.async_io import AsyncIOBuilder
from deepspeed.ops.op_builder.builder import OpBuilder
from deepspeed.ops.op_builder.cpu_adam import CPUAdamBuilder
from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder
from deepspeed.ops.op_builder.unsupported import STUB_BUILDERS
from deepspeed.ops.op_builder.utils import UtilsBuilder

#: Builders that compile real kernels in deepspeed-lean.
NATIVE_BUILDERS: tuple[type[OpBuilder], ...] = (CPUAdamBuilder, FusedAdamBuilder, UtilsBuilder, AsyncIOBuilder)

__op_builders__: list[OpBuilder] = [cls() for cls in NATIVE_BUILDERS] + [cls() for cls in STUB_BUILDERS.values()]
ALL_OPS: dict[str, OpBuilder] = {op.name: op for op in __op_builders__}
