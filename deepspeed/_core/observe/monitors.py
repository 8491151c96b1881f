"""Monitor writers: scalar events ``(tag, value, step)`` to TensorBoard, Weights & Biases, CSV files and Comet.

Each writer is built from its config block (the pydantic block or the run plan's policy; both carry the same
attribute names) and only on global rank 0, as upstream does; the other ranks hold ``None``. The libraries are
optional dependencies, imported when a writer is built: a missing one raises an ``ImportError`` naming the package.
``deepspeed.monitor`` re-exports these classes under upstream's module names.

A monitor used on its own writes in the caller's thread. :class:`MonitorMaster` (what the engine holds) hands its
batches to one background writer thread (:mod:`~deepspeed._core.observe.writer`): :meth:`MonitorMaster.flush` waits
for them, :meth:`MonitorMaster.close` also closes the files; both run for every live master at process exit, and a
write error surfaces on the next call, naming the monitor.
"""

from __future__ import annotations

import abc
import atexit
import csv
import importlib
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deepspeed._core.comm import dist
from deepspeed._core.observe.writer import BackgroundWriter

Event = tuple[str, Any, int]
"""``(tag, value, step)``; the step is the x-axis (samples seen)."""

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml", "csv_monitor": None}
"""The package each monitor block needs (``None``: the standard library is enough)."""


def global_rank() -> int:
    """This process's global rank (0 when no process group runs)."""
    return dist.get_rank() if dist.is_initialized() else 0


def import_optional(package: str, block: str) -> Any:
    """Import ``package`` for the ``block`` monitor, or raise an ``ImportError`` that says what to install."""
    try:
        return importlib.import_module(package)
    except ImportError as err:
        pip_name = package.replace("_", "-")
        raise ImportError(
            f"{block}.enabled=true needs the '{package}' package, which is not installed; install it with "
            f"`pip install {pip_name}` or set {block}.enabled to false"
        ) from err


def monitor_dir(output_path: str | None, job_name: str) -> str:
    """The directory of a file monitor: ``<output_path>/<job_name>``; ``None`` means ``~/tensorboard/<job id>/logs``."""
    if output_path is None:
        job_id = os.environ.get("DLWS_JOB_ID", os.environ.get("DLTS_JOB_ID", "unknown-job-id"))
        return os.path.join(os.path.expanduser("~"), "tensorboard", job_id, "logs")
    return os.path.join(output_path, job_name)


class Monitor(abc.ABC):
    """A writer of scalar events."""

    def __init__(self, monitor_config: Any) -> None:
        self.monitor_config = monitor_config

    @abc.abstractmethod
    def write_events(self, event_list: Sequence[Event]) -> None:
        """Write every ``(tag, value, step)`` of ``event_list``."""

    def write_unflushed(self, event_list: Sequence[Event]) -> None:
        """:meth:`write_events`, leaving the flush to :meth:`flush` (the background writer flushes per run of
        batches)."""
        self.write_events(event_list)


class TensorBoardMonitor(Monitor):
    """Scalars to ``events.out.tfevents.*`` files under ``<output_path>/<job_name>`` (``torch.utils.tensorboard``)."""

    def __init__(self, tensorboard_config: Any) -> None:
        super().__init__(tensorboard_config)
        self.enabled = tensorboard_config.enabled
        self.output_path = tensorboard_config.output_path
        self.job_name = tensorboard_config.job_name
        self.summary_writer: Any = None
        if self.enabled and global_rank() == 0:
            import_optional("tensorboard", "tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            self.log_dir = monitor_dir(self.output_path, self.job_name)
            os.makedirs(self.log_dir, exist_ok=True)
            self.summary_writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, event_list: Sequence[Event], flush: bool = True) -> None:
        """Add each event as a scalar; flush so a reader sees it at once."""
        if self.summary_writer is None:
            return
        for tag, value, step in event_list:
            self.summary_writer.add_scalar(tag, value, step)
        if flush:
            self.summary_writer.flush()

    def write_unflushed(self, event_list: Sequence[Event]) -> None:
        """Add the scalars, those of one step as one event record (TensorBoard reads each tag's value from it as it
        would from one record per tag: same tags, values and steps, at a fraction of the records to encode);
        the writer's own thread writes them, :meth:`flush` forces it."""
        if self.summary_writer is None:
            return
        from tensorboard.compat.proto.summary_pb2 import Summary  # type: ignore[import-untyped]

        by_step: dict[int, list[Any]] = {}
        for tag, value, step in event_list:  # the value add_scalar writes: a float32 simple_value
            by_step.setdefault(step, []).append(Summary.Value(tag=tag, simple_value=float(_plain(value))))
        file_writer = self.summary_writer._get_file_writer()
        for step, values in by_step.items():
            file_writer.add_summary(Summary(value=values), step)

    def flush(self) -> None:
        """Write buffered events to disk."""
        if self.summary_writer is not None:
            self.summary_writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        if self.summary_writer is not None:
            self.summary_writer.close()


class WandbMonitor(Monitor):
    """Scalars to a Weights & Biases run (``wandb.init(project, group, entity=team)`` on rank 0)."""

    def __init__(self, wandb_config: Any) -> None:
        super().__init__(wandb_config)
        self.enabled = wandb_config.enabled
        self.group = wandb_config.group
        self.team = wandb_config.team
        self.project = wandb_config.project
        self._wandb: Any = None
        if self.enabled and global_rank() == 0:
            self._wandb = import_optional("wandb", "wandb")
            self._wandb.init(project=self.project, group=self.group, entity=self.team)

    def log(self, data: dict[str, Any], step: int | None = None, commit: bool | None = None, sync: Any = None) -> None:
        """``wandb.log`` on rank 0."""
        if self._wandb is not None:
            self._wandb.log(data, step=step, commit=commit)

    def write_events(self, event_list: Sequence[Event]) -> None:
        """One ``wandb.log({tag: value}, step=step)`` per event."""
        for tag, value, step in event_list:
            self.log({tag: value}, step=step)


class csvMonitor(Monitor):  # upstream's lower-case class name
    """One CSV file per tag under ``<output_path>/<job_name>/`` (``/`` and spaces in the tag become ``_``).

    Each tag's file is opened once (appending) and kept open; :meth:`write_events` flushes the files it wrote,
    :meth:`close` closes them all.
    """

    def __init__(self, csv_config: Any) -> None:
        super().__init__(csv_config)
        self.filenames: list[str] = []
        self.enabled = csv_config.enabled
        self.output_path = csv_config.output_path
        self.job_name = csv_config.job_name
        self.log_dir = self.setup_log_dir()
        self._files: dict[str, tuple[Any, Any]] = {}  # tag -> (open file, csv writer)

    def setup_log_dir(self, base: str = os.path.join(os.path.expanduser("~"), "csv_monitor")) -> str | None:
        """Create (on rank 0) and return the directory the files go to."""
        if not self.enabled or global_rank() != 0:
            return None
        log_dir = monitor_dir(self.output_path, self.job_name) if self.output_path is not None else base
        os.makedirs(log_dir, exist_ok=True)
        return log_dir

    def _writer(self, tag: str, log_dir: str) -> Any:
        entry = self._files.get(tag)
        if entry is None:
            name = tag.replace("/", "_").replace(" ", "_")
            path = os.path.join(log_dir, f"{name}.csv")
            fd = open(path, "a", newline="")  # kept open across steps, closed by close()
            entry = self._files[tag] = (fd, csv.writer(fd))
            if path not in self.filenames:  # a file's first write in this process adds the header
                self.filenames.append(path)
                entry[1].writerow(["step", tag.split("/")[-1]])
        return entry[1]

    def write_unflushed(self, event_list: Sequence[Event]) -> None:
        """Append ``step,value`` to each tag's file (buffered until :meth:`flush`)."""
        if self.log_dir is None:
            return
        for tag, value, step in event_list:
            self._writer(tag, self.log_dir).writerow([step, _plain(value)])

    def write_events(self, event_list: Sequence[Event]) -> None:
        """Append ``step,value`` to each tag's file; a file's first write in this process adds the header."""
        self.write_unflushed(event_list)
        self.flush()

    def flush(self) -> None:
        """Push the buffered rows of every open file to disk."""
        for fd, _ in self._files.values():
            fd.flush()

    def close(self) -> None:
        """Flush and close every open file (a later write opens it again, appending)."""
        files, self._files = self._files, {}
        for fd, _ in files.values():
            fd.close()


def _plain(value: Any) -> Any:
    """A tensor scalar as a Python number (CSV rows hold numbers, not ``tensor(...)``)."""
    return value.item() if hasattr(value, "item") else value


class CometMonitor(Monitor):
    """Scalars to a Comet experiment (``comet_ml.start``); a tag is logged at its first event and then once at
    least ``samples_log_interval`` samples have passed since its last logged one."""

    def __init__(self, comet_config: Any) -> None:
        super().__init__(comet_config)
        self.enabled = comet_config.enabled
        self._samples_log_interval = comet_config.samples_log_interval
        self._experiment: Any = None
        self._last_logged: dict[str, int] = {}
        if self.enabled and global_rank() == 0:
            comet_ml = import_optional("comet_ml", "comet")
            self._experiment = comet_ml.start(
                api_key=comet_config.api_key,
                project=comet_config.project,
                workspace=comet_config.workspace,
                experiment_key=comet_config.experiment_key,
                mode=comet_config.mode,
                online=comet_config.online,
            )
            if comet_config.experiment_name is not None:
                self._experiment.set_name(comet_config.experiment_name)

    @property
    def experiment(self) -> Any:
        """The Comet experiment (``None`` off rank 0 or when disabled)."""
        return self._experiment

    @property
    def samples_log_interval(self) -> int:
        """Samples between two logged values of a tag."""
        return self._samples_log_interval

    def write_events(self, event_list: Sequence[Event]) -> None:
        """Log the events that are due."""
        if self._experiment is None:
            return
        for tag, value, step in event_list:
            last = self._last_logged.get(tag)
            if last is None or step - last >= self._samples_log_interval:
                self._experiment.log_metric(tag, _plain(value), step=step)
                self._last_logged[tag] = step


_LIVE_MASTERS: weakref.WeakSet[MonitorMaster] = weakref.WeakSet()


@atexit.register
def _close_live_masters() -> None:
    for master in list(_LIVE_MASTERS):
        master.close()


class MonitorMaster(Monitor):
    """Every enabled monitor of a config (``tensorboard``, ``wandb``, ``csv_monitor``, ``comet`` attributes),
    built on global rank 0 only; :meth:`write_events` hands the events to a background writer thread that fans
    them out to the monitors, in order."""

    def __init__(self, monitor_config: Any) -> None:
        super().__init__(monitor_config)
        self.tb_monitor: TensorBoardMonitor | None = None
        self.wandb_monitor: WandbMonitor | None = None
        self.csv_monitor: csvMonitor | None = None
        self.comet_monitor: CometMonitor | None = None
        self._writer: BackgroundWriter | None = None
        blocks = (monitor_config.tensorboard, monitor_config.wandb, monitor_config.csv_monitor, monitor_config.comet)
        self.enabled = any(block.enabled for block in blocks)
        if global_rank() != 0:
            return
        if monitor_config.tensorboard.enabled:
            self.tb_monitor = TensorBoardMonitor(monitor_config.tensorboard)
        if monitor_config.wandb.enabled:
            self.wandb_monitor = WandbMonitor(monitor_config.wandb)
        if monitor_config.csv_monitor.enabled:
            self.csv_monitor = csvMonitor(monitor_config.csv_monitor)
        if monitor_config.comet.enabled:
            self.comet_monitor = CometMonitor(monitor_config.comet)

    def monitors(self) -> list[tuple[str, Monitor]]:
        """The monitors built here, by config block name."""
        named = (
            ("tensorboard", self.tb_monitor),
            ("wandb", self.wandb_monitor),
            ("csv_monitor", self.csv_monitor),
            ("comet", self.comet_monitor),
        )
        return [(name, m) for name, m in named if m is not None]

    def write_events(self, event_list: Sequence[Event]) -> None:
        """Queue ``event_list`` for every monitor built here (nothing off rank 0); raises an earlier write error."""
        if global_rank() != 0 or not event_list:
            return
        if self._writer is None:
            sinks = self.monitors()
            if not sinks:
                return
            self._writer = BackgroundWriter(sinks)
            _LIVE_MASTERS.add(self)
        self._writer.submit(event_list)

    def flush(self) -> None:
        """Wait until every queued event is written and flushed; raises a write error, naming the monitor."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Write what is queued, close the monitors' files and stop the writer thread (a later write starts a new
        one); raises a write error, naming the monitor."""
        writer, self._writer = self._writer, None
        _LIVE_MASTERS.discard(self)
        if writer is not None:
            writer.close()


def unwritable_reason(directory: str) -> str | None:
    """Why files cannot be created in ``directory`` (created if missing), or ``None`` when they can."""
    path = Path(directory).expanduser().absolute()
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            return f"no existing parent of {str(path)!r}"
        probe = probe.parent
    if not probe.is_dir():
        return f"{str(probe)!r} exists and is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "the directory" if probe == path else f"its existing parent {str(probe)!r}"
        return f"{what} is not writable by this process"
    return None
