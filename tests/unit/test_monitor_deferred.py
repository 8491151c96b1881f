"""The monitors and phase timers never wait for the device in a step: values are read once their events report done,
written in order by a background thread, and everything left is written at shutdown.

On CPU every value is ready at once, so these tests give the monitoring code a fake device whose events complete
only when the test says so (one step behind, like a device running behind the host). Only the monitoring modules see
it; the rest of the engine runs on the CPU as usual.
"""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
import textwrap
from contextlib import redirect_stdout
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch

STEPS = 4


class FakeDevice:
    """A device clock: an event is done once the test has advanced the device past it."""

    def __init__(self) -> None:
        self.recorded = 0  # events recorded so far
        self.done = 0  # events the device has passed
        self.syncs = 0  # waits for an event or for the device

    def advance(self) -> None:
        """The device catches up with everything recorded so far."""
        self.done = self.recorded


def fake_event_class(device: FakeDevice) -> type:
    import time

    class FakeEvent:
        def __init__(self, enable_timing: bool = False, **_: Any) -> None:
            self.seq = -1
            self.at = 0.0

        def record(self, stream: Any = None) -> None:
            device.recorded += 1
            self.seq, self.at = device.recorded, time.perf_counter()

        def query(self) -> bool:
            return self.seq <= device.done

        def synchronize(self) -> None:
            device.syncs += 1
            device.done = max(device.done, self.seq)

        def elapsed_time(self, end: Any) -> float:
            assert self.query() and end.query(), "read before the device passed the event"
            return (end.at - self.at) * 1000.0

    return FakeEvent


class FakeAccelerator:
    """The real accelerator, but with asynchronous device events (and it counts synchronisations)."""

    def __init__(self, real: Any, device: FakeDevice) -> None:
        self._real, self._device = real, device
        self.Event = fake_event_class(device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def is_synchronized_device(self) -> bool:
        return False

    def use_host_timers(self) -> bool:
        return False

    def synchronize(self, device_index: int | None = None) -> None:
        self._device.syncs += 1
        self._device.advance()


def _install_fake_device() -> FakeDevice:
    import deepspeed._core.observe.deferred as deferred
    import deepspeed._core.observe.timers as timers
    from deepspeed.accelerator import get_accelerator

    device = FakeDevice()
    fake = FakeAccelerator(get_accelerator(), device)
    deferred.get_accelerator = timers.get_accelerator = lambda: fake  # type: ignore[attr-defined]
    return device


def _config(out: str, monitors: bool) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 10**9,
        "timers": {"throughput": {"synchronized": False}},  # the throughput timer's own waits are not monitoring
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    if monitors:
        cfg["csv_monitor"] = {"enabled": True, "output_path": out, "job_name": "j"}
        cfg["wall_clock_breakdown"] = True
    return cfg


def _read_reads(counts: dict[str, int]) -> Any:
    """Patch ``Tensor.item`` and ``Tensor.__float__`` to count the reads of tensor values."""
    import torch

    item, to_float = torch.Tensor.item, torch.Tensor.__float__

    def counted_item(self: Any) -> Any:
        counts["reads"] += 1
        return item(self)

    def counted_float(self: Any) -> float:
        counts["reads"] += 1
        return to_float(self)

    torch.Tensor.item, torch.Tensor.__float__ = counted_item, counted_float  # type: ignore[method-assign]
    return lambda: setattr(torch.Tensor, "item", item) or setattr(torch.Tensor, "__float__", to_float)


def _rows(path: Path) -> list[tuple[int, float]]:
    if not path.exists():
        return []
    with open(path, newline="") as fd:
        return [(int(r[0]), float(r[1])) for r in list(csv.reader(fd))[1:]]


def _lagging_run(out: str, monitors: bool) -> dict:
    """Train STEPS optimizer steps with the monitoring code on a fake device one step behind the host."""
    import deepspeed

    device = _install_fake_device()
    engine, *_ = deepspeed.initialize(model=make_model(0), config=_config(out, monitors))
    counts = {"reads": 0}
    folder = Path(out) / "j"
    losses, seen, lines = [], [], io.StringIO()
    with redirect_stdout(lines):
        for step in range(STEPS):
            device.advance()  # the device finished the previous step while the host queued this one
            restore = _read_reads(counts)
            try:
                for micro in range(2):
                    loss = engine(*micro_batch(step, micro))
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.detach().clone())
            finally:
                restore()
            engine.monitor.flush()  # what the writer thread got so far is on disk
            seen.append(len(_rows(folder / "Train_Samples_train_loss.csv")))
        syncs_in_steps = device.syncs
        lines_before_destroy = lines.getvalue().count("time (ms)")
        engine.destroy()
    return {
        "reads": counts["reads"],
        "syncs": syncs_in_steps,
        "rows_seen": seen,
        "lines_before_destroy": lines_before_destroy,
        "lines": lines.getvalue().count("time (ms)"),
        "loss": _rows(folder / "Train_Samples_train_loss.csv"),
        "fwd": _rows(folder / "Train_Samples_elapsed_time_ms_forward.csv"),
        "lr": _rows(folder / "Train_Samples_lr.csv"),
        "expected_loss": [float(sum(losses[2 * i : 2 * i + 2]) / 2) for i in range(STEPS)],
        "samples": engine.global_samples,
    }


def test_a_monitored_step_never_waits_and_shutdown_writes_the_rest(tmp_path: Path) -> None:
    on = run_distributed(_lagging_run, 1, str(tmp_path / "on"), True)[0]
    off = run_distributed(_lagging_run, 1, str(tmp_path / "off"), False)[0]
    # No monitoring read of a tensor value and no wait for an event or the device inside a step.
    assert on["syncs"] == 0, on
    assert on["reads"] == off["reads"], (on["reads"], off["reads"])
    # Each step's scalars reach the file one step later (when the device has passed them), never before.
    assert on["rows_seen"] == [0, 1, 2, 3], on["rows_seen"]
    # Two timer lines per optimizer step (GAS 2: micro, micro, global), the last step's printed at shutdown.
    assert on["lines"] == 3 * STEPS and on["lines_before_destroy"] == 3 * (STEPS - 1), on
    # Shutdown wrote the last step: every step, the same values, the samples as x-axis.
    samples = [4 * (i + 1) for i in range(STEPS)]
    assert [s for s, _ in on["loss"]] == samples and on["samples"] == samples[-1]
    assert [v for _, v in on["loss"]] == pytest.approx(on["expected_loss"], rel=1e-6)
    assert [s for s, _ in on["fwd"]] == samples and all(v > 0 for _, v in on["fwd"])
    assert [s for s, _ in on["lr"]] == samples


_EXIT_SCRIPT = """
import os, sys
sys.path.insert(0, {root!r})
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT={port!r}, RANK="0", LOCAL_RANK="0",
                  WORLD_SIZE="1")
import deepspeed
from deepspeed import comm as dist
from tests.unit.test_monitor_deferred import _config, _install_fake_device
from tests.reference.models import make_model, micro_batch
dist.init_distributed(dist_backend="gloo", verbose=False)
device = _install_fake_device()
engine, *_ = deepspeed.initialize(model=make_model(0), config=_config({out!r}, True))
for step in range(3):
    device.advance()
    for micro in range(2):
        engine.backward(engine(*micro_batch(step, micro)))
        engine.step()
# no destroy: the process exits with the last step still waiting for the (fake) device
"""


def test_process_exit_writes_the_last_step(tmp_path: Path) -> None:
    from tests._harness import _free_port

    root = str(Path(__file__).resolve().parents[2])
    script = _EXIT_SCRIPT.format(root=root, port=str(_free_port()), out=str(tmp_path))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, timeout=240)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert [s for s, _ in _rows(tmp_path / "j" / "Train_Samples_train_loss.csv")] == [4, 8, 12]
    assert done.stdout.decode().count("time (ms)") == 9  # the last step's timer lines too


class _Broken:
    def write_unflushed(self, events: Any) -> None:
        raise OSError("disk full")


def test_a_write_error_is_raised_on_the_next_call_naming_the_monitor(tmp_path: Path) -> None:
    from deepspeed._core.observe.writer import BackgroundWriter, MonitorWriteError

    written: list = []

    class _Good:
        def write_unflushed(self, events: Any) -> None:
            written.extend(events)

    writer = BackgroundWriter([("csv_monitor", _Broken()), ("tensorboard", _Good())])
    writer.submit([("a", 1.0, 1)])
    writer.flush_interval = 0.0
    with pytest.raises(MonitorWriteError, match="monitor 'csv_monitor' failed to write events: OSError: disk full"):
        writer.flush()
    assert written == [("a", 1.0, 1)]  # the other monitor still got the events
    writer.submit([("b", 2.0, 2)])
    with pytest.raises(MonitorWriteError, match="csv_monitor"):
        writer.close()
    assert written == [("a", 1.0, 1), ("b", 2.0, 2)]


def test_monitor_master_reports_a_failing_csv_monitor(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from deepspeed._core.config.plan import CometPolicy, FileMonitorPolicy, WandbPolicy
    from deepspeed._core.observe import monitors
    from deepspeed._core.observe.writer import MonitorWriteError

    cfg = SimpleNamespace(
        tensorboard=FileMonitorPolicy(),
        wandb=WandbPolicy(),
        comet=CometPolicy(),
        csv_monitor=FileMonitorPolicy(enabled=True, output_path=str(tmp_path), job_name="j"),
    )
    master = monitors.MonitorMaster(cfg)
    master.write_events([("Train/Samples/lr", 0.5, 4)])
    master.flush()
    assert (tmp_path / "j" / "Train_Samples_lr.csv").read_text().splitlines() == ["step,lr", "4,0.5"]
    monkeypatch.setattr(monitors.csvMonitor, "write_unflushed", _Broken.write_unflushed)
    master.write_events([("Train/Samples/lr", 0.25, 8)])
    with pytest.raises(MonitorWriteError, match="'csv_monitor'.*disk full"):
        master.close()


def test_timer_lines_wait_for_the_device_in_order_and_events_are_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed._core.observe import timers as timers_mod

    device = FakeDevice()
    made: list[Any] = []
    base = fake_event_class(device)

    class Counted(base):  # type: ignore[misc, valid-type]
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            made.append(self)

    fake = FakeAccelerator(timers_mod.get_accelerator(), device)
    fake.Event = Counted
    monkeypatch.setattr(timers_mod, "get_accelerator", lambda: fake)
    group = timers_mod.SynchronizedWallClockTimer()
    out = io.StringIO()
    with redirect_stdout(out):
        for step in range(5):
            device.advance()
            group("a").start()
            group("a").stop()
            assert group.log(["a"]) is None  # this step's interval is not done yet: nothing waits
            assert out.getvalue().count("time (ms) | a: ") == step  # the earlier steps' lines, in order
        assert device.syncs == 0
        group.flush()
    assert out.getvalue().count("time (ms) | a: ") == 5 and device.syncs == 1
    assert len(made) <= 4, len(made)  # two events per interval, handed out again once read


def test_gpu_scalars_land_in_a_reused_pinned_buffer_with_the_exact_values() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from deepspeed._core.observe.deferred import HostSlots, PendingScalars

    slots = HostSlots()
    losses = [torch.tensor(v, device="cuda", dtype=torch.bfloat16) for v in (1.5, 2.25)]
    first = PendingScalars([torch.stack(losses).float().mean(), losses[0]], slots)
    assert first.host.is_pinned()
    expected = [torch.stack(losses).float().mean().item(), losses[0].float().item()]
    assert first.values() == expected
    second = PendingScalars([losses[1]], slots)
    assert second.host is first.host  # the buffer read above is handed out again
    assert second.values() == [2.25]


def test_tensorboard_one_record_per_step_reads_back_as_add_scalar_writes(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from deepspeed._core.config.plan import FileMonitorPolicy
    from deepspeed._core.observe.monitors import TensorBoardMonitor

    events = [
        [("Train/Samples/lr", 1e-3, 4), ("Train/Samples/train_loss", 2.718281828, 4), ("x y", torch.tensor(0.1), 4)],
        [("Train/Samples/lr", 2e-3, 8), ("Train/Samples/train_loss", 1.5, 8), ("x y", 0.2, 8)],
    ]
    read = {}
    for how in ("write_events", "write_unflushed"):  # upstream's path (add_scalar) and the writer thread's
        monitor = TensorBoardMonitor(FileMonitorPolicy(enabled=True, output_path=str(tmp_path), job_name=how))
        for batch in events:
            getattr(monitor, how)(batch)
        monitor.close()
        acc = EventAccumulator(str(tmp_path / how))
        acc.Reload()
        read[how] = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert read["write_unflushed"] == read["write_events"] and len(read["write_events"]) == 3, read


def test_cpu_memory_reads_go_through_one_kept_descriptor_per_process() -> None:
    """The CPU 'allocated memory' of a monitored phase is this process's RSS, read from a descriptor opened once
    (per process: a forked child opens its own), and equal to what psutil reports."""
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("needs /proc")
    import psutil

    from deepspeed.accelerator import cpu_accelerator

    first = cpu_accelerator._process_rss()
    fd = cpu_accelerator._STATM[os.getpid()]
    assert fd >= 0 and cpu_accelerator._process_rss() > 0 and cpu_accelerator._STATM[os.getpid()] == fd
    assert abs(first - psutil.Process().memory_info().rss) < 64 << 20
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's figures come from its own descriptor
        cpu_accelerator._process_rss()
        os.write(write, b"1" if cpu_accelerator._STATM.get(os.getpid(), fd) != fd else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
