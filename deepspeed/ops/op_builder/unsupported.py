"""Builders that deepspeed-lean names but does not compile.

They exist so ``from deepspeed.ops.op_builder import XBuilder`` resolves, ``ds_report`` can list them,
and callers that test ``is_compatible()`` skip cleanly. ``load()`` raises with the reason.
"""

from __future__ import annotations

from types import ModuleType

from deepspeed.ops.op_builder.builder import OpBuilder


class NotImplementedBuilder(OpBuilder):
    """An op with no native implementation here; ``REASON`` says what runs instead."""

    NAME = "not_implemented"
    BUILD_VAR = "DS_BUILD_NOT_IMPLEMENTED"
    REASON = "not implemented in deepspeed-lean"

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name=name if name is not None else self.NAME)

    def sources(self) -> list[str]:
        """No sources."""
        return []

    def incompatibility_reasons(self) -> list[str]:
        """Always the one reason."""
        return [self.REASON]

    def is_built(self) -> bool:
        """Never built."""
        return False

    def load(self, verbose: bool = False) -> ModuleType:
        """Always raises ``NotImplementedError``."""
        raise NotImplementedError(f"op '{self.name}': {self.REASON}")


_TORCH_IMPL = "no native kernel; the Python optimizer runs a pure-torch implementation"

# (class name, NAME, BUILD_VAR, reason). Names and variables are upstream's interface.
_STUBS = (
    ("CPUAdagradBuilder", "cpu_adagrad", "DS_BUILD_CPU_ADAGRAD", _TORCH_IMPL),
    ("CPULionBuilder", "cpu_lion", "DS_BUILD_CPU_LION", _TORCH_IMPL),
    ("FusedLionBuilder", "fused_lion", "DS_BUILD_FUSED_LION", _TORCH_IMPL),
    ("FusedLambBuilder", "fused_lamb", "DS_BUILD_FUSED_LAMB", NotImplementedBuilder.REASON),
    ("GDSBuilder", "gds", "DS_BUILD_GDS", NotImplementedBuilder.REASON),
    ("QuantizerBuilder", "quantizer", "DS_BUILD_QUANTIZER", NotImplementedBuilder.REASON),
    ("FPQuantizerBuilder", "fp_quantizer", "DS_BUILD_FP_QUANTIZER", NotImplementedBuilder.REASON),
    ("TransformerBuilder", "transformer", "DS_BUILD_TRANSFORMER", NotImplementedBuilder.REASON),
    ("InferenceBuilder", "transformer_inference", "DS_BUILD_TRANSFORMER_INFERENCE", NotImplementedBuilder.REASON),
    ("RaggedOpsBuilder", "ragged_device_ops", "DS_BUILD_RAGGED_DEVICE_OPS", NotImplementedBuilder.REASON),
    ("RaggedUtilsBuilder", "ragged_ops", "DS_BUILD_RAGGED_OPS", NotImplementedBuilder.REASON),
    ("RandomLTDBuilder", "random_ltd", "DS_BUILD_RANDOM_LTD", NotImplementedBuilder.REASON),
    ("EvoformerAttnBuilder", "evoformer_attn", "DS_BUILD_EVOFORMER_ATTN", NotImplementedBuilder.REASON),
)


def _make_stub(class_name: str, name: str, build_var: str, reason: str) -> type[NotImplementedBuilder]:
    doc = f"``{name}`` ({build_var}): {reason}."
    return type(
        class_name,
        (NotImplementedBuilder,),
        {"NAME": name, "BUILD_VAR": build_var, "REASON": reason, "__doc__": doc, "__module__": __name__},
    )


STUB_BUILDERS: dict[str, type[NotImplementedBuilder]] = {c: _make_stub(c, n, v, r) for c, n, v, r in _STUBS}
globals().update(STUB_BUILDERS)
