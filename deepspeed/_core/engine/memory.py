"""Model-state memory floors, the per-phase memory report (config ``memory_breakdown``) and the one-step
allocator-history recorder (config ``memory_timeline``).

A floor is the bytes that the parameters, gradients and Adam-style optimizer state must occupy per rank for a
ZeRO stage, before activations and transients (the ZeRO paper's accounting: 2 + 2 + K bytes per parameter in
mixed precision, each term divided by the data-parallel size from the stage that partitions it).

The recorder only records: it turns the allocator history on for the configured step, takes the snapshot and
writes it. What the snapshot means (categories, timeline, chart) is a tool's business
(``deepspeed/tools/profiling/memory_timeline``), which the engine façade hands in as a :class:`SnapshotAnalyser`;
this package never imports it.
"""

from __future__ import annotations

import enum
import logging
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from deepspeed._core.comm import dist
from deepspeed._core.config.plan import MemoryTimelinePolicy, RunPlan
from deepspeed._foundation.logging import log_dist, logger
from deepspeed.accelerator import get_accelerator

_GIB = float(1 << 30)


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class StateFloor:
    """Per-rank bytes of model state on the device and on the host, for one configuration."""

    device: float
    host: float


def optimizer_state_bytes(plan: RunPlan) -> int:
    """K: bytes of Adam-style optimizer state per parameter. Two moments in the master's dtype, plus the master
    itself when it is not the working parameter: 12 in mixed precision (fp32 master and moments), 8 in pure fp32
    (12 once offloaded: the host master is a copy of the device parameters), 6 with
    ``bf16_master_weights_and_grads`` and ``bf16_optimizer_states`` (bf16 master and moments)."""
    master = _nbytes(plan.precision.master_dtype)
    separate_master = plan.precision.param_dtype != torch.float32 or plan.zero.offload_optimizer.enabled
    return 2 * master + (master if separate_master else 0)


def host_grads_offloaded(plan: RunPlan) -> bool:
    """Whether an offloaded optimizer's gradients wait for the step in host memory: always at ZeRO-1/2; at ZeRO-3
    unless they wait in the parameters' shards ([Note: parked grads])."""
    if not plan.zero.offload_optimizer.enabled:
        return False
    parked = plan.zero.lean.grads_in_param_shards and plan.batch.gradient_accumulation_steps == 1
    return plan.zero.stage < 3 or not parked


def model_state_floor(plan: RunPlan, n_params: int, dp_world: int) -> StateFloor:
    """Device/host floor for ``n_params`` trainable parameters at ``plan``'s stage and world size (the formulas of
    docs/memory_floors.md and docs/offload.md)."""
    bp = _nbytes(plan.precision.param_dtype)
    bg = _nbytes(plan.precision.grad_accum_dtype)
    k = optimizer_state_bytes(plan)
    p, n, stage = float(n_params), float(max(dp_world, 1)), plan.zero.stage
    optimizer_bytes = k * p / n if stage >= 1 else k * p
    grads = bg * p / n if stage >= 2 else bg * p
    params = bp * p / n if stage >= 3 else bp * p
    if plan.zero.offload_optimizer.enabled:
        host_grads = bg * p / n if host_grads_offloaded(plan) else 0.0
        return StateFloor(device=params + grads, host=optimizer_bytes + host_grads)
    return StateFloor(device=params + grads + optimizer_bytes, host=0.0)


HostProbe = Callable[[], int]
"""Bytes of model state an offloaded optimizer holds in host memory now (``host_state_bytes``)."""


def _host_rss() -> float:
    """This process's resident host memory in bytes (0 where psutil is missing)."""
    try:
        import psutil
    except ImportError:
        return 0.0
    return float(psutil.Process().memory_info().rss)


class MemoryReporter:
    """Logs allocated / reserved / peak device memory at named phases, next to the model-state floor.

    Args:
        plan: run plan (its ``memory_breakdown`` switch turns reports on).
        n_params: trainable parameters of the model.
        dp_world: data-parallel size.
        analyser: what turns a recorded ``memory_timeline`` snapshot into a report (``None``: snapshot only).
    """

    def __init__(self, plan: RunPlan, n_params: int, dp_world: int, analyser: SnapshotAnalyser | None = None) -> None:
        self.enabled = plan.memory_breakdown
        self.floor = model_state_floor(plan, n_params, dp_world)
        # Parameters this rank holds host state for: host bytes per parameter compare with the floor's K (+ bg).
        self.host_share = max(1.0, n_params / max(dp_world, 1)) if plan.zero.stage >= 1 else float(max(n_params, 1))
        self.host_probe: HostProbe | None = None  # set by the engine when the optimizer is offloaded
        self.records: list[dict[str, float | str]] = []
        self.timeline = TimelineRecorder(plan.memory_timeline, analyser)

    def report(self, phase: str) -> dict[str, float | str] | None:
        """Record (and log on rank 0) the memory at ``phase``; returns the record when enabled.

        While a ``memory_timeline`` step is being recorded, ``phase`` is also marked on its timeline.
        """
        self.timeline.mark(phase)
        if not self.enabled:
            return None
        acc = get_accelerator()
        record: dict[str, float | str] = {
            "phase": phase,
            "allocated_gib": acc.memory_allocated() / _GIB,
            "reserved_gib": acc.memory_reserved() / _GIB,
            "peak_gib": acc.max_memory_allocated() / _GIB,
            "floor_gib": self.floor.device / _GIB,
        }
        host = self._host_figures()
        record.update(host)
        self.records.append(record)
        log_dist(
            f"memory {phase}: {self._measured(acc, record)}; {self._floor_text(record)}{self._host_text(host)}",
            ranks=[0],
        )
        return record

    @staticmethod
    def _measured(acc: Any, record: dict[str, float | str]) -> str:
        if acc.device_name() == "cpu":
            # No device allocator on a CPU: the accelerator answers with the process's resident memory, which
            # includes the Python runtime and libraries, so it is named as such rather than as "allocated".
            return f"process resident memory {record['allocated_gib']:.3f} GiB (peak {record['peak_gib']:.3f} GiB)"
        return (
            f"allocated {record['allocated_gib']:.3f} GiB, reserved {record['reserved_gib']:.3f} GiB, "
            f"peak {record['peak_gib']:.3f} GiB"
        )

    def _floor_text(self, record: dict[str, float | str]) -> str:
        host = f", {self.floor.host / _GIB:.3f} GiB on host" if self.floor.host else ""
        return f"model-state floor {record['floor_gib']:.3f} GiB on device{host}"

    @staticmethod
    def _host_text(host: dict[str, float]) -> str:
        if not host:
            return ""
        return (
            f"; host model state {host['host_bytes_per_param']:.2f} bytes/param (floor "
            f"{host['host_floor_bytes_per_param']:.2f}), host RSS {host['host_rss_gib']:.3f} GiB"
        )

    def _host_figures(self) -> dict[str, float]:
        """With an offloaded optimizer: its host model state per parameter next to the host floor per parameter,
        and the process's resident host memory."""
        if self.host_probe is None:
            return {}
        return {
            "host_bytes_per_param": self.host_probe() / self.host_share,
            "host_floor_bytes_per_param": self.floor.host / self.host_share,
            "host_rss_gib": _host_rss() / _GIB,
        }


class SnapshotReport(Protocol):
    """What a :class:`SnapshotAnalyser` wrote for one snapshot."""

    @property
    def summary(self) -> dict[str, Any]:
        """The summary (``peak_allocated_bytes``, ``peak_by_category``, ...)."""

    @property
    def files(self) -> list[str]:
        """The files written."""

    @property
    def skipped(self) -> list[str]:
        """Files not written, each with the reason."""


class SnapshotAnalyser(Protocol):
    """Turns an allocator snapshot into a report; the engine façade supplies one (the core defines only this)."""

    def tensor_hints(self, module: torch.nn.Module, optimizer: Any) -> list[dict[str, Any]]:
        """Addresses and categories of the model state, stored in the snapshot as ``category_hints``."""

    def write_report(self, snapshot: dict[str, Any], device: int, prefix: str, title: str) -> SnapshotReport:
        """Write the report files of ``snapshot`` on ``device`` next to ``prefix``."""


class _Recording(enum.Enum):
    WAITING = "waiting"  # the configured step has not started yet
    ON = "on"
    DONE = "done"  # written, disabled, or not supported on this device


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class TimelineRecorder:
    """Records the allocator history of one optimizer step and writes it (config ``memory_timeline``).

    The engine calls :meth:`begin` at every micro-step start, :meth:`mark` at phase points and :meth:`finish`
    after every optimizer step. Recording costs a Python stack per allocation, so only the chosen step pays it.

    Args:
        policy: the ``memory_timeline`` policy of the run plan.
        analyser: adds ``category_hints`` to the snapshot and writes the report files; ``None`` writes the
            snapshot alone.
    """

    def __init__(self, policy: MemoryTimelinePolicy, analyser: SnapshotAnalyser | None = None) -> None:
        self.policy = policy
        self.analyser = analyser
        self.state = _Recording.WAITING if policy.enabled else _Recording.DONE
        self.phases: list[dict[str, Any]] = []
        self.written: list[str] = []
        if policy.enabled and not get_accelerator().memory_history_supported():
            log_dist(
                f"memory_timeline: recording an allocator history needs a CUDA device; the "
                f"{get_accelerator().device_name()} accelerator has none, so no timeline is written",
                ranks=[0],
                level=logging.WARNING,
            )
            self.state = _Recording.DONE

    def begin(self, completed_steps: int) -> None:
        """Start recording if the step after ``completed_steps`` optimizer steps is the configured one."""
        if self.state is _Recording.WAITING and completed_steps + 1 == self.policy.step:
            get_accelerator().record_memory_history(True, self.policy.max_entries)
            self.state = _Recording.ON
            self.mark("start")

    def mark(self, phase: str) -> None:
        """Note ``phase`` at the current wall-clock time (the trace's ``time_us`` clock) while recording."""
        if self.state is _Recording.ON:
            self.phases.append({"name": phase, "time_us": time.time_ns() / 1000.0})

    def finish(self, completed_steps: int, module: torch.nn.Module, optimizer: Any) -> dict[str, Any] | None:
        """After the configured optimizer step: stop recording, write the files and return the summary."""
        if self.state is not _Recording.ON or completed_steps < self.policy.step:
            return None
        acc = get_accelerator()
        snapshot = acc.memory_snapshot()
        acc.record_memory_history(False)
        self.state = _Recording.DONE
        if snapshot is None:  # recording starts only where memory_history_supported() promised a snapshot
            raise RuntimeError(
                f"memory_timeline: the {acc.device_name()} accelerator recorded an allocator history "
                "but returned no snapshot"
            )
        device = acc.current_device()
        if self.analyser is not None:
            snapshot["category_hints"] = self.analyser.tensor_hints(module, optimizer)
        snapshot["recording"] = {
            "step": self.policy.step,
            "rank": _rank(),
            "device": device,
            "max_entries": self.policy.max_entries,
            "phases": self.phases,
        }
        return self._write(snapshot, device)

    def _write(self, snapshot: dict[str, Any], device: int) -> dict[str, Any] | None:
        prefix = Path(f"{self.policy.path}_rank{_rank()}")
        prefix.parent.mkdir(parents=True, exist_ok=True)
        pickle_path = prefix.with_name(prefix.name + ".pickle")
        with open(pickle_path, "wb") as fd:
            pickle.dump(snapshot, fd)
        self.written = [str(pickle_path)]
        if self.analyser is None:
            logger.info(f"memory_timeline step {self.policy.step}: wrote {self.written}")
            return None
        report = self.analyser.write_report(
            snapshot, device, str(prefix), title=f"step {self.policy.step}, rank {_rank()}, device {device}"
        )
        self.written.extend(report.files)
        for skipped in report.skipped:
            logger.warning(f"memory_timeline: skipped {skipped}")
        summary = report.summary
        peak = summary["peak_by_category"]
        logger.info(
            f"memory_timeline step {self.policy.step}: peak {summary['peak_allocated_bytes'] / _GIB:.3f} GiB "
            f"({', '.join(f'{k} {v / _GIB:.3f}' for k, v in peak.items() if v)}); wrote {self.written}"
        )
        return summary
