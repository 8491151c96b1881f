"""Core binding for ``--bind_cores_to_rank``: which cores each local rank gets, as a ``numactl`` prefix."""

from __future__ import annotations

import os
import shutil


def parse_core_list(core_list: str) -> list[int]:
    """Parse ``"0-3,8,10-11"`` into ``[0, 1, 2, 3, 8, 10, 11]`` (order kept, repeats dropped).

    Raises:
        ValueError: a token is neither ``N`` nor ``A-B`` with ``A <= B``.
    """
    cores: list[int] = []
    for token in core_list.split(","):
        start, sep, end = token.strip().partition("-")
        if not start.isdigit() or (sep and not end.isdigit()):
            raise ValueError(f"--bind_core_list: malformed entry {token!r} (expected N or A-B)")
        first, last = int(start), int(end) if sep else int(start)
        if last < first:
            raise ValueError(f"--bind_core_list: range {token!r} is descending")
        cores.extend(range(first, last + 1))
    return list(dict.fromkeys(cores))


def available_cores() -> list[int]:
    """Cores this process may run on (its CPU affinity), in ascending order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cores_for_rank(cores: list[int], num_local_ranks: int, local_rank: int) -> list[int]:
    """The contiguous share of ``cores`` for ``local_rank``; leftovers go to the lowest ranks.

    Raises:
        ValueError: fewer cores than ranks, so some rank would get none.
    """
    if len(cores) < num_local_ranks:
        raise ValueError(f"cannot bind {num_local_ranks} ranks to {len(cores)} cores: need at least one core per rank")
    base, extra = divmod(len(cores), num_local_ranks)
    start = local_rank * base + min(local_rank, extra)
    return cores[start : start + base + (1 if local_rank < extra else 0)]


def format_core_list(cores: list[int]) -> str:
    """Compress ``[0, 1, 2, 5]`` into numactl's ``"0-2,5"``."""
    spans: list[str] = []
    run_start = prev = cores[0]
    for core in [*cores[1:], None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        spans.append(str(run_start) if run_start == prev else f"{run_start}-{prev}")
        if core is not None:
            run_start = prev = core
    return ",".join(spans)


def numactl_prefix(cores: list[int]) -> list[str]:
    """``numactl`` argv prefix that pins a process to ``cores``."""
    return ["numactl", "-C", format_core_list(cores)]


def require_numactl() -> None:
    """Fail early, before any rank starts, when core binding was asked for but numactl is missing."""
    if shutil.which("numactl") is None:
        raise ValueError("--bind_cores_to_rank needs the 'numactl' program, which is not on PATH")
