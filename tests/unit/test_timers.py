"""``wall_clock_breakdown`` prints the phase timers under upstream's names; the ``timers`` block drives the
throughput timer; ``deepspeed.utils.timer`` keeps upstream's classes."""

from __future__ import annotations

import contextlib
import io
import time
from types import SimpleNamespace

import pytest

from deepspeed.utils.timer import (
    STEP_GLOBAL_TIMER,
    NoopTimer,
    SynchronizedWallClockTimer,
    ThroughputTimer,
    trim_mean,
)
from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch

MICRO_NAMES = ["fwd_microstep", "bwd_microstep", "bwd_inner_microstep", "bwd_allreduce_microstep", "step_microstep"]
GLOBAL_NAMES = ["fwd", "bwd", "bwd_inner", "bwd_allreduce", "step"]


def _timer_lines(extra: dict, steps: int, gas: int) -> dict:
    import deepspeed

    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-2}},
        **extra,
    }
    engine, *_ = deepspeed.initialize(model=make_model(0), config=cfg)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for step in range(steps):
            for micro in range(gas):
                engine.backward(engine(*micro_batch(step, micro)))
                if step == micro == 0:
                    breakdown = engine.get_wall_clock_timers()  # before step() prints and resets them
                engine.step()
    lines = [ln for ln in out.getvalue().splitlines() if "time (ms)" in ln]
    return {
        "lines": lines,
        "breakdown": breakdown,
        "timers": type(engine.timers).__name__,
        "tput_steps": engine.tput_timer.global_step_count,
        "tput_micro": engine.tput_timer.micro_step_count,
    }


def _names(line: str) -> list[str]:
    return [part.split(":")[0].strip() for part in line.split(" | ")[1:]]


def test_wall_clock_breakdown_prints_micro_and_global_timers() -> None:
    out = run_distributed(_timer_lines, 1, {"wall_clock_breakdown": True}, 2, 2)[0]
    lines = out["lines"]
    assert all(ln.startswith("[Rank 0] time (ms) | ") for ln in lines), lines
    micro = [ln for ln in lines if _names(ln) == MICRO_NAMES]
    glob = [ln for ln in lines if _names(ln) == GLOBAL_NAMES]
    assert len(micro) == 4 and len(glob) == 2 and len(lines) == 6, lines  # every step(); every boundary
    fwd = [float(ln.split(" | ")[1].split(": ")[1]) for ln in glob]
    assert all(v > 0 for v in fwd)
    assert out["timers"] == "SynchronizedWallClockTimer"
    assert {"fwd", "bwd", "bwd_inner", "fwd_microstep"} <= set(out["breakdown"]) and out["breakdown"]["fwd"] > 0


def test_no_breakdown_prints_nothing_and_times_nothing() -> None:
    out = run_distributed(_timer_lines, 1, {}, 2, 1)[0]
    assert out["lines"] == [] and out["timers"] == "NoopTimer" and out["breakdown"] == {}


def test_timers_block_turns_the_throughput_timer_off() -> None:
    on = run_distributed(_timer_lines, 1, {}, 3, 2)[0]
    off = run_distributed(_timer_lines, 1, {"timers": {"throughput": {"enabled": False}}}, 3, 2)[0]
    assert (on["tput_steps"], on["tput_micro"]) == (3, 6)
    assert (off["tput_steps"], off["tput_micro"]) == (0, 0)


def test_timers_block_is_read_and_a_bad_key_is_named() -> None:
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    cfg = DeepSpeedConfig({"train_batch_size": 1, "timers": {"throughput": {"synchronized": False}}})
    assert (cfg.timers_config.enabled, cfg.timers_config.synchronized) == (True, False)
    assert cfg.plan.timers.throughput.synchronized is False
    with pytest.raises(DeepSpeedConfigError, match="synchronised"):
        DeepSpeedConfig({"train_batch_size": 1, "timers": {"throughput": {"synchronised": False}}})
    with pytest.raises(DeepSpeedConfigError, match="timers.throughput.enabled"):
        DeepSpeedConfig({"train_batch_size": 1, "timers": {"throughput": {"enabled": "often"}}})


def _tput(enabled: bool = True, synchronized: bool = True, **kwargs: object) -> tuple[ThroughputTimer, list[str]]:
    lines: list[str] = []
    cfg = SimpleNamespace(enabled=enabled, synchronized=synchronized)
    return ThroughputTimer(cfg, batch_size=8, logging_fn=lines.append, **kwargs), lines  # type: ignore[arg-type]


def test_throughput_timer_reports_on_its_period() -> None:
    timer, lines = _tput(start_step=1, steps_per_output=2)
    assert timer.avg_samples_per_sec() == float("-inf")
    for _ in range(4):
        timer.start()
        time.sleep(0.01)
        timer.stop(global_step=True)
    assert timer.global_step_count == 4 and timer.micro_step_count == 4
    assert len(lines) == 2 and lines[0].startswith("epoch=0/micro_step=2/global_step=2, RunningAvgSamplesPerSec=")
    for part in ("CurrSamplesPerSec=", "MemAllocated=", "MaxMemAllocated="):
        assert part in lines[0]
    assert 8 / 0.05 < timer.avg_samples_per_sec() < 8 / 0.01  # three timed steps of at least 10 ms
    timer.update_epoch_count()
    assert (timer.epoch_count, timer.micro_step_count) == (1, 0)


def test_throughput_timer_synchronizes_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.accelerator import get_accelerator

    calls = []
    monkeypatch.setattr(type(get_accelerator()), "synchronize", lambda self, *a: calls.append(1))
    for synchronized, expected in ((True, 4), (False, 0)):
        calls.clear()
        timer, _ = _tput(synchronized=synchronized, start_step=0)
        for _ in range(2):
            timer.start()
            timer.stop(global_step=True)
        assert len(calls) == expected


def test_throughput_timer_disabled_and_bad_period() -> None:
    timer, lines = _tput(enabled=False, steps_per_output=1)
    timer.start()
    timer.stop(global_step=True)
    assert timer.global_step_count == 0 and lines == []
    with pytest.raises(ValueError, match="steps_per_output"):
        _tput(steps_per_output=0)
    assert ThroughputTimer(SimpleNamespace(enabled=True, synchronized=False), None).batch_size == 1


def test_wall_clock_timer_accumulates_and_resets(capsys: pytest.CaptureFixture[str]) -> None:
    timers = SynchronizedWallClockTimer()
    for _ in range(2):
        timers(STEP_GLOBAL_TIMER).start()
        time.sleep(0.01)
        timers(STEP_GLOBAL_TIMER).stop()
    assert timers(STEP_GLOBAL_TIMER).elapsed(reset=False) >= 20.0
    line = timers.log(["step", "absent"])
    assert line.startswith("time (ms) | step: ") and "absent" not in line
    assert capsys.readouterr().out.startswith("[Rank 0] time (ms) | step: ")
    assert timers(STEP_GLOBAL_TIMER).elapsed() == 0  # log reset it
    with pytest.raises(RuntimeError, match="not started"):
        timers("x").stop()
    assert NoopTimer()("anything").elapsed() == 0 and NoopTimer().get_timers() == {}


def test_trim_mean() -> None:
    # 20 values, 10 % trimmed at each end: two 1s and two 100s go.
    assert trim_mean([1.0, 2.0, 3.0, 100.0] * 5, 0.1) == pytest.approx((1 * 3 + 2 * 5 + 3 * 5 + 100 * 3) / 16)
    assert trim_mean([], 0.1) == 0


ZERO12_NAMES = ["optimizer_allgather", "optimizer_gradients", "optimizer_step"]


def _zero_timers(stage: int, breakdown: bool, nvme_path: str | None = None) -> dict:
    """Two optimizer steps (2 ranks) of a ZeRO run; the printed timer lines and the timers left afterwards."""
    import deepspeed
    from deepspeed import comm as dist

    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "wall_clock_breakdown": breakdown,
    }
    if nvme_path is not None:
        cfg["optimizer"]["params"] = {"lr": 1e-2}
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path}
    engine, *_ = deepspeed.initialize(model=make_model(0), config=cfg)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for step in range(2):
            engine.backward(engine(*micro_batch(step, dist.get_rank())))
            engine.step()
    lines = [ln for ln in out.getvalue().splitlines() if "time (ms)" in ln]
    return {"lines": lines, "names": sorted(engine.get_wall_clock_timers())}


@pytest.mark.parametrize("stage,names", [(1, ZERO12_NAMES), (2, ZERO12_NAMES), (3, ["optimizer_step"])])
def test_zero_optimizer_timers_follow_wall_clock_breakdown(stage: int, names: list[str]) -> None:
    """With the switch, each ZeRO step prints and keeps upstream's ``optimizer_*`` timers (rank 0 prints);
    without it there are neither lines nor timers."""
    on = run_distributed(_zero_timers, 2, stage, True)
    lines = [ln for ln in on[0]["lines"] if ln.startswith("[Rank 0] time (ms) | optimizer_")]
    assert [_names(ln) for ln in lines] == [names, names], on[0]["lines"]  # one line per optimizer step
    assert all(float(ln.split("optimizer_step: ")[1].split()[0]) > 0 for ln in lines), lines
    assert on[1]["lines"] == []  # printing is rank 0's
    for res in on:
        assert set(names) <= set(res["names"]), res["names"]
    off = run_distributed(_zero_timers, 2, stage, False)
    for res in off:
        assert res["lines"] == [] and res["names"] == [], res


NVME_NAMES = ["optimizer_swap_in_state", "optimizer_step", "optimizer_swap_out_state"]


def test_nvme_swap_timers_follow_wall_clock_breakdown(tmp_path: object) -> None:
    """ZeRO-3 with the optimizer state in NVMe swap files also prints upstream's swap-in and swap-out timers, with
    time in them (the reads and writes are waited for)."""
    on = run_distributed(_zero_timers, 2, 3, True, str(tmp_path))
    lines = [ln for ln in on[0]["lines"] if ln.startswith("[Rank 0] time (ms) | optimizer_")]
    assert [_names(ln) for ln in lines] == [NVME_NAMES, NVME_NAMES], on[0]["lines"]
    for name in NVME_NAMES:
        assert all(float(ln.split(f"{name}: ")[1].split()[0]) > 0 for ln in lines), (name, lines)
    off = run_distributed(_zero_timers, 2, 3, False, str(tmp_path))
    assert all(res["lines"] == [] and res["names"] == [] for res in off), off


def test_zero3_prints_init_optimizer_state_once_with_wall_clock_breakdown() -> None:
    """ZeRO-3 times the creation of the optimizer state under upstream's ``init_optimizer_state`` name: the first
    step creates it, so that step prints the line once (before its ``optimizer_step`` line); later steps do not."""
    from deepspeed.runtime.zero.stage3 import INIT_OPTIMIZER_TIMER

    assert INIT_OPTIMIZER_TIMER == "init_optimizer_state"
    on = run_distributed(_zero_timers, 2, 3, True)
    lines = [ln for ln in on[0]["lines"] if ln.startswith("[Rank 0] time (ms) | ")]
    init = [ln for ln in lines if _names(ln) == [INIT_OPTIMIZER_TIMER]]
    assert len(init) == 1 and lines.index(init[0]) == 0, lines
    assert float(init[0].split(f"{INIT_OPTIMIZER_TIMER}: ")[1]) > 0
    assert INIT_OPTIMIZER_TIMER in on[0]["names"]
    off = run_distributed(_zero_timers, 2, 3, False)
    assert all(INIT_OPTIMIZER_TIMER not in ln for res in off for ln in res["lines"]), off
