"""``UtilsBuilder``: multi-tensor flatten / unflatten (CUDA kernel; a CPU-only build copies with memcpy)."""

from __future__ import annotations

from deepspeed.ops.op_builder.builder import CUDAOpBuilder


class UtilsBuilder(CUDAOpBuilder):
    """Builds ``csrc/utils/flatten_unflatten{.cu,_frontend.cpp}``.

    The module exposes ``flatten(tensors)``, ``unflatten(flat, tensors)`` (the old UtilsBuilder
    contract), ``flatten_into(tensors, out, offsets)``, ``unflatten_from(flat, tensors, offsets)`` and
    ``has_cuda_kernel()``. Without a CUDA toolkit it builds the CPU part only.
    """

    BUILD_VAR = "DS_BUILD_UTILS"
    NAME = "utils"
    CUDA_REQUIRED = False

    def __init__(self) -> None:
        super().__init__(name=self.NAME)

    def absolute_name(self) -> str:
        """Import path of the ahead-of-time build."""
        return f"deepspeed.ops.{self.NAME}_op"

    def cpp_sources(self) -> list[str]:
        """The torch binding with the CPU copy path."""
        return ["csrc/utils/flatten_unflatten_frontend.cpp"]

    def cuda_sources(self) -> list[str]:
        """The multi-tensor copy kernel."""
        return ["csrc/utils/flatten_unflatten.cu"]
