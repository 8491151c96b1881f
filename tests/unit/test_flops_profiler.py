"""The FLOPs profiler counts what the analytic formulas give on known shapes, attributes counts to modules, prints
upstream's layout, and the engine writes the profile at ``flops_profiler.profile_step``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from deepspeed.profiling.flops_profiler import (
    FlopsProfiler,
    get_model_profile,
    get_module_flops,
    macs_to_string,
    number_to_string,
    params_to_string,
)
from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch


def _counts(model: nn.Module, *args: torch.Tensor) -> tuple[int, int, int]:
    flops, macs, params = get_model_profile(model, args=list(args), print_profile=False, as_string=False, warm_up=0)
    return int(flops), int(macs), int(params)


def test_linear_counts_equal_the_analytic_count() -> None:
    batch, seq, n_in, n_out = 4, 3, 16, 24
    flops, macs, params = _counts(nn.Linear(n_in, n_out), torch.randn(batch, seq, n_in))
    assert macs == batch * seq * n_in * n_out
    assert flops == 2 * macs
    assert params == n_in * n_out + n_out


class _MatMul(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b)


def test_batched_matmul_counts_equal_the_analytic_count() -> None:
    b, m, k, n = 3, 5, 7, 11
    flops, macs, params = _counts(_MatMul(), torch.randn(b, m, k), torch.randn(b, k, n))
    assert (flops, macs, params) == (2 * b * m * k * n, b * m * k * n, 0)


@pytest.mark.parametrize("groups", [1, 2])
def test_conv_counts_equal_the_analytic_count(groups: int) -> None:
    n, c_in, c_out, h, w, kernel, stride = 2, 4, 6, 9, 8, 3, 2
    conv = nn.Conv2d(c_in, c_out, kernel, stride=stride, groups=groups)
    flops, macs, _ = _counts(conv, torch.randn(n, c_in, h, w))
    h_out, w_out = (h - kernel) // stride + 1, (w - kernel) // stride + 1
    assert macs == n * c_out * h_out * w_out * (c_in // groups) * kernel * kernel
    assert flops == 2 * macs


def test_input_shape_builds_the_input_and_strings_follow_upstream() -> None:
    flops, macs, params = get_model_profile(nn.Linear(1000, 1000), input_shape=(1000, 1000), print_profile=False)
    assert (flops, macs, params) == ("2 G", "1 GMACs", "1 M")
    assert number_to_string(1.5e12) == "1.5 T" and params_to_string(7e9) == "7 B"
    assert macs_to_string(0) == "0 MACs"


class _KeywordModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.proj = nn.Linear(8, 50, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.proj(self.embed(input_ids))


def test_keyword_inputs_are_passed_as_given() -> None:
    ids = torch.randint(0, 50, (2, 7))
    flops, macs, params = get_model_profile(
        _KeywordModel(), kwargs={"input_ids": ids, "attention_mask": None}, print_profile=False, as_string=False
    )
    assert (flops, macs, params) == (2 * 2 * 7 * 8 * 50, 2 * 7 * 8 * 50, 50 * 8 + 8 * 50)


def test_counts_are_attributed_to_the_module_that_ran_them() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4)))
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(5, 8))
    prof.stop_profile()
    assert get_module_flops(model[0]) == 2 * 5 * 8 * 16
    assert get_module_flops(model[2]) == 2 * 5 * 16 * 4
    assert get_module_flops(model[1]) == 5 * 16  # the ReLU: one flop per element, no MACs
    assert prof.get_total_flops() == 2 * 5 * (8 * 16 + 16 * 4) + 5 * 16
    assert prof.get_total_macs() == 5 * (8 * 16 + 16 * 4)
    assert model[0].__params__ == 8 * 16 + 16 and prof.get_total_params() == 8 * 16 + 16 + 16 * 4 + 4
    assert prof.get_total_duration() > 0
    prof.end_profile()
    assert not hasattr(model[0], "__flops__")


def test_report_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sub" / "profile.txt"
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    get_model_profile(model, input_shape=(5, 8), output_file=str(out), top_modules=2)
    text = out.read_text()
    assert capsys.readouterr().out == ""  # went to the file
    for label in (
        "-------------------------- DeepSpeed Flops Profiler --------------------------",
        "Profile Summary at step 1:",
        "Notations:",
        "params per GPU: ",
        "fwd MACs per GPU: ",
        "fwd flops of model = fwd flops per GPU * mp_size: ",
        "fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ",
        "----------------------------- Aggregated Profile per GPU -----------------------------",
        "Top 2 modules in terms of params, MACs or fwd latency at different model depths:",
        "depth 0:",
        "    params      - {",
        "------------------------------ Detailed Profile per GPU ------------------------------",
        "% MACs",
    ):
        assert label in text, label
    line = next(ln for ln in text.splitlines() if ln.startswith("fwd flops per GPU: "))
    flops = 2 * 5 * (8 * 16 + 16 * 4) + 5 * 16  # the two linears and the ReLU
    assert line == "{:<70}  {:<8}".format("fwd flops per GPU: ", number_to_string(flops))
    assert "world size: " not in text  # engine lines only with an engine
    assert "MFU: " in text and "not computed" in text  # the CPU accelerator knows no peak


def test_mfu_is_reported_against_the_accelerators_peak(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "peak_flops", lambda self, dtype, device_index=None: 1e6)
    out = tmp_path / "p.txt"
    get_model_profile(nn.Linear(8, 16), input_shape=(5, 8), output_file=str(out))
    line = next(ln for ln in out.read_text().splitlines() if ln.startswith("MFU = fwd FLOPS per GPU / device peak"))
    fwd = next(ln for ln in out.read_text().splitlines() if ln.startswith("fwd FLOPS per GPU"))
    assert line.rstrip().endswith("%") and "1 MFLOPS" in line and fwd


def _engine_profile(out: str, steps: int) -> dict:
    import deepspeed

    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-2}},
        "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": out, "detailed": False},
    }
    engine, *_ = deepspeed.initialize(model=make_model(0), config=cfg)
    written_at = None
    for step in range(steps):
        engine.backward(engine(*micro_batch(step, 0)))
        engine.step()
        if written_at is None and Path(out).exists():
            written_at = engine.global_steps
    return {"written_at": written_at, "attrs_left": hasattr(engine.module.fc1, "__flops__")}


def test_engine_writes_the_profile_at_profile_step(tmp_path: Path) -> None:
    out = tmp_path / "flops.txt"
    result = run_distributed(_engine_profile, 1, str(out), 3)[0]
    assert result["written_at"] == 2 and not result["attrs_left"]
    text = out.read_text()
    assert "Profile Summary at step 2:" in text
    tokens, hidden, vocab = 3 * 5, 23, 37
    flops = 2 * tokens * (hidden * (2 * hidden + 1) * 2 + hidden * vocab)  # fc1, fc2, head
    # relu, the residual add, layer norm (5 per element with its weight), the loss's log-softmax
    flops += tokens * (2 * hidden + 1) + tokens * hidden + 5 * tokens * hidden + tokens * vocab
    # Value lines: the label left-aligned in 70 columns, two spaces, the value.
    values = {ln[:70].strip(): ln[72:].strip() for ln in text.splitlines() if len(ln) > 72 and ln[70:72] == "  "}
    assert values["fwd flops per GPU:"] == number_to_string(flops)
    assert values["world size:"] == "1" and values["batch size per GPU:"] == "3"
    for label in ("bwd latency:", "step latency:", "iter latency:", "samples/second:"):
        assert label in values, label  # the profiler turns the engine timers on
