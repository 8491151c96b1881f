"""Supervise child processes: first failure stops the rest, signals are forwarded, nothing is orphaned.

Used by both the runner (one child: the per-node launcher or the multi-node tool) and the per-node
launcher (one child per local rank). The contract:

* a child that exits non-zero makes every other child get SIGTERM, then SIGKILL after a grace period,
  and :meth:`Supervisor.wait` returns that child's exit code (``128 + N`` when it died of signal N);
* SIGINT/SIGTERM/SIGHUP received by the supervising process are forwarded, as the same signal, to
  every child, which is then reaped the same way; ``wait`` returns ``128 + signal``;
* descendants of a child (dataloader workers, helpers) are found with psutil before the child is
  signalled, so they are killed too instead of being re-parented to init;
* on Linux every child also asks the kernel for SIGTERM if its supervisor dies (``PR_SET_PDEATHSIG``),
  which covers the one case no handler can: the supervisor being SIGKILLed.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import IO

import psutil

from deepspeed._foundation.logging import logger
from deepspeed.launcher.constants import POLL_INTERVAL_SECONDS, TERMINATE_GRACE_SECONDS

_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def exit_code_of(returncode: int) -> int:
    """Shell convention for a child's status: its code, or ``128 + N`` when signal N killed it."""
    return returncode if returncode >= 0 else 128 - returncode


def _load_prctl() -> object | None:
    # Resolved once in the parent: loading a library between fork and exec is not safe.
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def _child_preexec(parent_pid: int) -> None:
    """Runs in the child between fork and exec: die with the parent, even if it is SIGKILLed."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)  # type: ignore[operator]
        # The parent may have died before prctl took effect; then nobody would ever signal us.
        if os.getppid() != parent_pid:
            os._exit(1)


@dataclass
class Child:
    """One supervised process and what it needs closing when it is gone."""

    label: str
    process: subprocess.Popen
    log_file: IO[bytes] | None = None


class Supervisor:
    """Starts children and waits for them under the fail-fast contract in the module docstring."""

    def __init__(
        self, grace_seconds: float = TERMINATE_GRACE_SECONDS, poll_seconds: float = POLL_INTERVAL_SECONDS
    ) -> None:
        self.children: list[Child] = []
        self._grace = grace_seconds
        self._poll = poll_seconds
        self._signals: list[int] = []

    def spawn(
        self, label: str, argv: Sequence[str], env: Mapping[str, str], log_path: str | None = None
    ) -> subprocess.Popen:
        """Start ``argv`` with ``env``; stdout and stderr go to ``log_path`` when given.

        If starting fails, the children started so far are stopped before the error propagates.
        """
        # Not a `with`: the file must stay open for the child's lifetime; _close_logs closes it.
        log_file = open(log_path, "wb") if log_path else None
        try:
            process = subprocess.Popen(
                list(argv),
                env=dict(env),
                stdout=log_file,
                stderr=subprocess.STDOUT if log_file else None,
                preexec_fn=functools.partial(_child_preexec, os.getpid()),
            )
        except BaseException:
            if log_file:
                log_file.close()
            self.terminate_all(signal.SIGTERM)
            raise
        self.children.append(Child(label, process, log_file))
        logger.debug(f"started {label} (pid {process.pid}): {' '.join(argv)}")
        return process

    @property
    def signalled(self) -> bool:
        """Whether a forwarded signal (not a child's failure or success) ended :meth:`wait`."""
        return bool(self._signals)

    def wait(self) -> int:
        """Block until every child exited, one failed, or a signal arrived; return the exit code to use."""
        with self._forwarding_signals():
            while True:
                if self._signals:
                    signum = self._signals[0]
                    logger.warning(f"received {signal.Signals(signum).name}; stopping {len(self._alive())} process(es)")
                    self.terminate_all(signum)
                    return 128 + signum
                failed = next((c for c in self.children if c.process.poll() not in (None, 0)), None)
                if failed is not None:
                    code = exit_code_of(failed.process.returncode)
                    others = len(self._alive())
                    logger.error(f"{failed.label} exited with code {code}; stopping {others} other process(es)")
                    self.terminate_all(signal.SIGTERM)
                    return code
                if not self._alive():
                    self._close_logs()
                    return 0
                time.sleep(self._poll)

    def terminate_all(self, signum: int) -> None:
        """Send ``signum`` to live children, SIGKILL whatever (including descendants) outlives the grace period."""
        alive = self._alive()
        descendants = self._descendants(alive)
        for child in alive:
            _send(child.process.pid, signum)
        # A second signal during the grace period does not shorten it: Ctrl-C in a terminal reaches every
        # process of the group at once and is then forwarded again, so "second signal" is the normal case.
        deadline = time.monotonic() + self._grace
        while self._alive() and time.monotonic() < deadline:
            time.sleep(self._poll)
        for child in self._alive():
            _send(child.process.pid, signal.SIGKILL)
        for proc in descendants:
            with contextlib.suppress(psutil.Error):  # already gone
                proc.kill()
        for child in self.children:
            child.process.wait()
        self._close_logs()

    def _alive(self) -> list[Child]:
        return [c for c in self.children if c.process.poll() is None]

    @staticmethod
    def _descendants(children: list[Child]) -> list[psutil.Process]:
        found: list[psutil.Process] = []
        for child in children:
            with contextlib.suppress(psutil.Error):  # exited between the poll and now
                found.extend(psutil.Process(child.process.pid).children(recursive=True))
        return found

    def _close_logs(self) -> None:
        for child in self.children:
            if child.log_file is not None and not child.log_file.closed:
                child.log_file.close()

    def _record_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only record: the wait loop acts on it, outside the handler, where blocking is safe.
        self._signals.append(signum)

    @contextmanager
    def _forwarding_signals(self) -> Iterator[None]:
        previous = {}
        try:
            for signum in _FORWARDED_SIGNALS:
                previous[signum] = signal.signal(signum, self._record_signal)
        except ValueError:
            # Not the main thread (an embedding caller): handlers cannot be installed; failures still propagate.
            logger.debug("signal handlers not installed: not in the main thread")
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def _send(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # exited on its own meanwhile
        os.kill(pid, signum)
