"""``CPUAdamBuilder``: the SIMD + OpenMP CPU Adam/AdamW used by ZeRO optimizer offload."""

from __future__ import annotations

from deepspeed.ops.op_builder.builder import OpBuilder


class CPUAdamBuilder(OpBuilder):
    """Builds ``csrc/adam/cpu_adam.cpp`` (module functions ``create_adam``, ``adam_update``, ``destroy_adam``)."""

    BUILD_VAR = "DS_BUILD_CPU_ADAM"
    NAME = "cpu_adam"

    def __init__(self) -> None:
        super().__init__(name=self.NAME)

    def absolute_name(self) -> str:
        """Import path of the ahead-of-time build."""
        return f"deepspeed.ops.adam.{self.NAME}_op"

    def sources(self) -> list[str]:
        """The single C++ source."""
        return ["csrc/adam/cpu_adam.cpp"]

    def cxx_args(self) -> list[str]:
        """OpenMP for parallel_for, native SIMD width, no FMA contraction (rounds like torch), vectorisable sqrt, and
        floating-point selects the compiler may turn into vector blends (no code here reads FP exception flags;
        results are unchanged: the fp16 conversions are bit-exact with it, ``tests/kernels/test_cpu_adam.py``)."""
        return super().cxx_args() + [
            "-fopenmp",
            "-march=native",
            "-ffp-contract=off",
            "-fno-math-errno",
            "-fno-trapping-math",
        ]

    def extra_ldflags(self) -> list[str]:
        """Link OpenMP (resolves to the libgomp torch already loaded)."""
        return ["-fopenmp"]
