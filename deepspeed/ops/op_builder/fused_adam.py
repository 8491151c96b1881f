"""``FusedAdamBuilder``: the multi-tensor fused Adam/AdamW CUDA kernel."""

from __future__ import annotations

from deepspeed.ops.op_builder.builder import CUDAOpBuilder


class FusedAdamBuilder(CUDAOpBuilder):
    """Builds ``csrc/adam/fused_adam.cu`` with its binding (module function ``multi_tensor_adam``)."""

    BUILD_VAR = "DS_BUILD_FUSED_ADAM"
    NAME = "fused_adam"

    def __init__(self) -> None:
        super().__init__(name=self.NAME)

    def absolute_name(self) -> str:
        """Import path of the ahead-of-time build."""
        return f"deepspeed.ops.adam.{self.NAME}_op"

    def cpp_sources(self) -> list[str]:
        """The torch binding."""
        return ["csrc/adam/fused_adam_frontend.cpp"]

    def cuda_sources(self) -> list[str]:
        """The kernel."""
        return ["csrc/adam/fused_adam.cu"]
