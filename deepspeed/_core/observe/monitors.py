"""Monitor writers: scalar events ``(tag, value, step)`` to TensorBoard, Weights & Biases, CSV files and Comet.

Each writer is built from its config block (the pydantic block or the run plan's policy; both carry the same
attribute names) and only on global rank 0, as upstream does; the other ranks hold ``None``. The libraries are
optional dependencies, imported when a writer is built: a missing one raises an ``ImportError`` naming the package.
``deepspeed.monitor`` re-exports these classes under upstream's module names.
"""

from __future__ import annotations

import abc
import csv
import importlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deepspeed._core.comm import dist

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

    def flush(self) -> None:
        """Write buffered events to disk."""
        if self.summary_writer is not None:
            self.summary_writer.flush()


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
    """One CSV file per tag under ``<output_path>/<job_name>/`` (``/`` and spaces in the tag become ``_``)."""

    def __init__(self, csv_config: Any) -> None:
        super().__init__(csv_config)
        self.filenames: list[str] = []
        self.enabled = csv_config.enabled
        self.output_path = csv_config.output_path
        self.job_name = csv_config.job_name
        self.log_dir = self.setup_log_dir()

    def setup_log_dir(self, base: str = os.path.join(os.path.expanduser("~"), "csv_monitor")) -> str | None:
        """Create (on rank 0) and return the directory the files go to."""
        if not self.enabled or global_rank() != 0:
            return None
        log_dir = monitor_dir(self.output_path, self.job_name) if self.output_path is not None else base
        os.makedirs(log_dir, exist_ok=True)
        return log_dir

    def write_events(self, event_list: Sequence[Event]) -> None:
        """Append ``step,value`` to each tag's file; a file's first write in this process adds the header."""
        if self.log_dir is None:
            return
        for tag, value, step in event_list:
            name = tag.replace("/", "_").replace(" ", "_")
            path = os.path.join(self.log_dir, f"{name}.csv")
            with open(path, "a", newline="") as fd:
                writer = csv.writer(fd)
                if path not in self.filenames:
                    self.filenames.append(path)
                    writer.writerow(["step", tag.split("/")[-1]])
                writer.writerow([step, _plain(value)])


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


class MonitorMaster(Monitor):
    """Every enabled monitor of a config (``tensorboard``, ``wandb``, ``csv_monitor``, ``comet`` attributes),
    built on global rank 0 only; :meth:`write_events` fans out to them."""

    def __init__(self, monitor_config: Any) -> None:
        super().__init__(monitor_config)
        self.tb_monitor: TensorBoardMonitor | None = None
        self.wandb_monitor: WandbMonitor | None = None
        self.csv_monitor: csvMonitor | None = None
        self.comet_monitor: CometMonitor | None = None
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

    def write_events(self, event_list: Sequence[Event]) -> None:
        """Write ``event_list`` to every monitor built here (nothing off rank 0)."""
        if global_rank() != 0:
            return
        for monitor in (self.tb_monitor, self.wandb_monitor, self.csv_monitor, self.comet_monitor):
            if monitor is not None:
                monitor.write_events(event_list)


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
