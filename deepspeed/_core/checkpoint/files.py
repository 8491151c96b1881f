"""Checkpoint file I/O: crash-safe writes and pickle-safe reads.

[Note: atomic checkpoint files]
Every file is written to ``<name>.tmp-<pid>``, flushed and fsync'd, then renamed over ``<name>`` with
``os.replace`` (atomic on POSIX), and the directory entry is fsync'd. A reader therefore sees either
the old file or the complete new one, never a torn one. The orchestration (``checkpointing.py``)
writes the ``latest`` pointer the same way and only after every rank has committed its files, so a
process killed mid-save leaves the previously saved tag loadable.

[Note: safe checkpoint loading]
Checkpoints are pickles, and unpickling can run arbitrary code. Files are read with
``torch.load(weights_only=True)``, which only rebuilds tensors, containers and primitives, plus an
explicit allow-list of the few classes DeepSpeed checkpoints hold (loss scalers, ``ZeroStageEnum``).
Classes registered by the user with ``torch.serialization.add_safe_globals`` are honoured too.
Trusted legacy files holding other objects can be read with full pickle by setting the environment
variable ``DS_CHECKPOINT_TRUSTED=1`` (see :class:`LoadTrust`); this is a deliberate, visible opt-out.
"""

from __future__ import annotations

import contextlib
import enum
import os
import pickle
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from deepspeed._core.optim.loss_scaling import DynamicLossScaler, LossScaler, LossScalerBase

TRUST_ENV = "DS_CHECKPOINT_TRUSTED"
_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})

# Classes our own checkpoints pickle. Their ``__module__`` is the upstream façade path, which is the
# name both our pickles and upstream's record, so these entries also admit upstream files.
_SAFE_GLOBALS: list[Any] = [LossScalerBase, LossScaler, DynamicLossScaler]

# Test seam for crash-safety tests: called with the final path after each file is committed.
post_commit_hook: Callable[[str], None] | None = None


class LoadTrust(enum.Enum):
    """How much a checkpoint file is trusted when it is unpickled."""

    SAFE = "safe"  # weights_only=True plus the allow-list (default)
    TRUSTED = "trusted"  # full pickle: only for files you wrote yourself or otherwise trust

    @classmethod
    def from_env(cls) -> LoadTrust:
        """``TRUSTED`` when ``DS_CHECKPOINT_TRUSTED`` is set to a true word, else ``SAFE``."""
        return cls.TRUSTED if os.environ.get(TRUST_ENV, "").strip().lower() in _TRUE_WORDS else cls.SAFE


class CheckpointError(RuntimeError):
    """A checkpoint file could not be used; the message names the file and the reading rank."""

    def __init__(self, message: str, path: str, rank: int | None) -> None:
        super().__init__(message)
        self.path = path
        self.rank = rank


class CheckpointFileMissingError(CheckpointError, FileNotFoundError):
    """A file the checkpoint layout requires does not exist."""


class CheckpointCorruptError(CheckpointError):
    """A file exists but cannot be decoded (truncated, not a torch file) or lacks required entries."""


class CheckpointUnsafeError(CheckpointError, pickle.UnpicklingError):
    """A file references a class or function outside the allow-list; it was not executed."""


def register_safe_globals(objects: Iterable[Any]) -> None:
    """Add classes to the allow-list used by :func:`load_file` (façades register their own)."""
    for obj in objects:
        if obj not in _SAFE_GLOBALS:
            _SAFE_GLOBALS.append(obj)


def safe_globals() -> list[Any]:
    """A copy of the current allow-list."""
    return list(_SAFE_GLOBALS)


def where(path: str, rank: int | None) -> str:
    """``"'<path>' (rank N)"``: the location phrase every error message uses."""
    return f"'{path}'" if rank is None else f"'{path}' (rank {rank})"


# --- writing ----------------------------------------------------------------------------------------
def atomic_save(obj: Any, path: str) -> None:
    """``torch.save(obj)`` to ``path`` so that ``path`` is either untouched or complete."""
    _atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_text(text: str, path: str) -> None:
    """Write ``text`` (UTF-8, no trailing newline added) to ``path`` atomically."""
    _atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def atomic_copy(src: str, dst: str) -> None:
    """Copy the file ``src`` to ``dst`` atomically (used for the bundled ``zero_to_fp32.py``)."""
    with open(src, "rb") as f:
        data = f.read()
    _atomic_write(dst, lambda out: out.write(data))


def _atomic_write(path: str, write: Callable[[Any], Any]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    if post_commit_hook is not None:
        post_commit_hook(path)


def _fsync_dir(directory: str) -> None:
    # Makes the rename itself durable; some file systems (and all of Windows) refuse, which only
    # weakens durability after a power loss, not atomicity, so failures are ignored.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --- reading ----------------------------------------------------------------------------------------
def load_file(
    path: str,
    rank: int | None,
    trust: LoadTrust = LoadTrust.SAFE,
    map_location: Any = "cpu",
    mmap: bool = False,
) -> Any:
    """Load a checkpoint file, raising a :class:`CheckpointError` that names ``path`` and ``rank``.

    Args:
        path: the file.
        rank: the global rank reading it (for error messages), or ``None`` outside a process group.
        trust: :attr:`LoadTrust.SAFE` (weights-only with the allow-list) or :attr:`LoadTrust.TRUSTED`.
        map_location: forwarded to ``torch.load``.
        mmap: map the file instead of reading it (tensors are paged in when touched), for readers that need
            only slices of large files.
    """
    if not os.path.isfile(path):
        raise CheckpointFileMissingError(f"checkpoint file {where(path, rank)} does not exist", path, rank)
    try:
        if trust is LoadTrust.TRUSTED:
            return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
        with _allowed_globals():
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as err:  # torch raises many types for one cause; classified below
        raise _classify_load_error(err, path, rank) from err


@contextlib.contextmanager
def _allowed_globals() -> Iterator[None]:
    with torch.serialization.safe_globals(list(_SAFE_GLOBALS)):
        yield


def _classify_load_error(err: Exception, path: str, rank: int | None) -> CheckpointError:
    """Tell a refused global (a security decision) from a damaged file."""
    unsafe = _disallowed_globals(path) if isinstance(err, pickle.UnpicklingError) else []
    if unsafe:
        return CheckpointUnsafeError(
            f"refused to load checkpoint file {where(path, rank)}: it references {', '.join(unsafe)}, which "
            "is not on the safe-loading allow-list, so it was not executed. If the file comes from a source "
            "you trust, register the class with torch.serialization.add_safe_globals([...]) or set "
            f"{TRUST_ENV}=1 to load it with full pickle.",
            path,
            rank,
        )
    return CheckpointCorruptError(
        f"checkpoint file {where(path, rank)} is truncated or corrupt ({type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else 'no detail'}); re-save it or load an earlier tag",
        path,
        rank,
    )


def _disallowed_globals(path: str) -> list[str]:
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - an undecodable file is reported as corrupt by the caller
        return []
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in _SAFE_GLOBALS}
    allowed |= {
        f"{g.__module__}.{g.__qualname__}" for g in torch.serialization.get_safe_globals() if not isinstance(g, tuple)
    }
    return [name for name in found if name not in allowed]


def require_keys(state: Any, keys: Iterable[str], path: str, rank: int | None) -> None:
    """Raise :class:`CheckpointCorruptError` unless ``state`` is a dict holding every key in ``keys``."""
    if not isinstance(state, dict):
        raise CheckpointCorruptError(
            f"checkpoint file {where(path, rank)} holds a {type(state).__name__}, expected a dict", path, rank
        )
    missing = [k for k in keys if k not in state]
    if missing:
        raise CheckpointCorruptError(
            f"checkpoint file {where(path, rank)} lacks the entries {missing}; it was not written by a "
            "matching DeepSpeed configuration (ZeRO stage or precision differ?)",
            path,
            rank,
        )
