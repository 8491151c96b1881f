"""Op builder contract (names, registry, compatibility reasons) and ds_report."""

from __future__ import annotations

import pytest
import torch

from deepspeed.ops import op_builder
from deepspeed.ops.op_builder import (
    ALL_OPS,
    CPUAdamBuilder,
    FusedAdamBuilder,
    UtilsBuilder,
    csrc_root,
)


def test_builder_names_match_upstream() -> None:
    assert (CPUAdamBuilder.NAME, CPUAdamBuilder.BUILD_VAR) == ("cpu_adam", "DS_BUILD_CPU_ADAM")
    assert (FusedAdamBuilder.NAME, FusedAdamBuilder.BUILD_VAR) == ("fused_adam", "DS_BUILD_FUSED_ADAM")
    assert (UtilsBuilder.NAME, UtilsBuilder.BUILD_VAR) == ("utils", "DS_BUILD_UTILS")
    assert CPUAdamBuilder().absolute_name() == "deepspeed.ops.adam.cpu_adam_op"
    assert FusedAdamBuilder().absolute_name() == "deepspeed.ops.adam.fused_adam_op"
    for name in (
        "CPUAdagradBuilder",
        "CPULionBuilder",
        "FusedLionBuilder",
        "FusedLambBuilder",
        "AsyncIOBuilder",
        "GDSBuilder",
        "QuantizerBuilder",
        "TransformerBuilder",
        "RaggedUtilsBuilder",
    ):
        assert getattr(op_builder, name)().NAME in ALL_OPS


def test_sources_resolve_from_the_checkout() -> None:
    assert (csrc_root() / "adam" / "cpu_adam.cpp").is_file()
    for builder in (CPUAdamBuilder(), FusedAdamBuilder(), UtilsBuilder()):
        assert all(src.startswith("csrc/") for src in builder.sources())
        assert "sources not found" not in " ".join(builder.incompatibility_reasons())


def test_fused_adam_reason_without_cuda_torch() -> None:
    if torch.version.cuda is not None:
        pytest.skip("this torch has CUDA")
    builder = FusedAdamBuilder()
    assert not builder.is_compatible()
    assert "no CUDA" in builder.error_log
    assert UtilsBuilder().sources() == ["csrc/utils/flatten_unflatten_frontend.cpp"]


def test_stub_builders_refuse_to_load() -> None:
    stub = op_builder.FusedLambBuilder()
    assert not stub.is_compatible()
    with pytest.raises(NotImplementedError, match="fused_lamb"):
        stub.load()


def test_ds_report_lists_every_op(capsys: pytest.CaptureFixture[str]) -> None:
    from deepspeed import env_report

    env_report.main()
    text = capsys.readouterr().out
    for name in ALL_OPS:
        assert name in text
    assert "torch version" in text and "ninja" in text
    assert "fused_adam" in text and ("falling back" in text or "kernel" in text)


def test_report_and_builders_agree_on_the_cuda_toolkit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A toolkit ds_report lists is never called missing by an op's status line (one lookup serves both)."""
    import torch.utils.cpp_extension as cpp

    from deepspeed import env_report
    from deepspeed.ops.op_builder import builder

    monkeypatch.setattr(cpp, "CUDA_HOME", None)
    monkeypatch.setattr(builder.shutil, "which", lambda name: "/opt/cuda/bin/nvcc" if name == "nvcc" else None)
    monkeypatch.setattr(torch.version, "cuda", None)
    nvcc_row = dict(env_report.environment_rows())["nvcc"]
    assert nvcc_row.startswith("/opt/cuda/bin/nvcc")
    reasons = builder.CUDAOpBuilder.cuda_reasons(builder.CUDAOpBuilder.__new__(builder.CUDAOpBuilder))
    assert reasons == [
        "this torch build has no CUDA; the CUDA toolkit at /opt/cuda/bin/nvcc needs a CUDA build of torch"
    ]
    monkeypatch.setattr(builder.shutil, "which", lambda name: None)
    assert dict(env_report.environment_rows())["nvcc"] == "not found"
    reasons = builder.CUDAOpBuilder.cuda_reasons(builder.CUDAOpBuilder.__new__(builder.CUDAOpBuilder))
    assert reasons == ["this torch build has no CUDA"]
