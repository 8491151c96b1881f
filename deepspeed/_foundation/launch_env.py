"""Which launcher started this process, and the rendezvous values that follow from its variables.

torch's ``env://`` rendezvous reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (and DeepSpeed
picks the device from ``LOCAL_RANK``). torchrun and the ``deepspeed`` launcher export these names; ``mpirun`` and
``srun`` export their own instead. This module is the one place that knows each launcher's names: it reads them,
checks that a launcher's set is complete, and returns one :class:`LaunchEnv`.

A launcher whose variables are only partly present (``RANK`` without ``WORLD_SIZE``, ``SLURM_PROCID`` without
``SLURM_NTASKS``...) raises :class:`LaunchEnvError` naming what is missing: starting a world of 1 there would make
every process believe it is rank 0 and either train alone or fight over the rendezvous port.

It imports nothing heavy (no torch), so the launcher's per-rank shim can use it before the user's program starts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass


class LaunchEnvError(RuntimeError):
    """The environment holds some of a launcher's rank variables but not all the ones needed."""


@dataclass(frozen=True)
class LauncherVars:
    """The variable names one launcher exports to every process it starts."""

    name: str
    rank: str
    world_size: tuple[str, ...]  # first present wins (SLURM: the job step's count before the job's)
    local_rank: str
    local_size: str | None
    local_rank_required: bool = False


TORCH = LauncherVars("torchrun / deepspeed launcher", "RANK", ("WORLD_SIZE",), "LOCAL_RANK", "LOCAL_WORLD_SIZE")
OPEN_MPI = LauncherVars(
    "Open MPI",
    "OMPI_COMM_WORLD_RANK",
    ("OMPI_COMM_WORLD_SIZE",),
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
)
PMI = LauncherVars("MPICH / Intel MPI (PMI)", "PMI_RANK", ("PMI_SIZE",), "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
MVAPICH = LauncherVars(
    "MVAPICH2",
    "MV2_COMM_WORLD_RANK",
    ("MV2_COMM_WORLD_SIZE",),
    "MV2_COMM_WORLD_LOCAL_RANK",
    "MV2_COMM_WORLD_LOCAL_SIZE",
)
# srun exports SLURM_PROCID only to the tasks it starts (an sbatch/salloc shell has SLURM_NTASKS but no task id
# of its own that means "one of N"), so SLURM_PROCID is what marks a SLURM task.
SLURM = LauncherVars(
    "SLURM (srun)",
    "SLURM_PROCID",
    ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
    "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE",
    local_rank_required=True,
)
MPI_FLAVOURS = (OPEN_MPI, PMI, MVAPICH)
TOOLS = (*MPI_FLAVOURS, SLURM)

SLURM_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
SLURM_LAUNCH_ADDR = "SLURM_LAUNCH_NODE_IPADDR"


@dataclass(frozen=True)
class LaunchEnv:
    """Rank layout of this process as its launcher described it.

    ``master_addr`` is ``None`` when the launcher does not say where rank 0 runs and the job is not on one node
    (the caller then needs ``MASTER_ADDR`` or another way to find it).
    """

    launcher: LauncherVars
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    master_addr: str | None

    def torch_env(self) -> dict[str, str]:
        """The torch/DeepSpeed names for this layout (``MASTER_ADDR`` only when known)."""
        env = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_SIZE": str(self.local_size),
            "LOCAL_WORLD_SIZE": str(self.local_size),
        }
        if self.master_addr is not None:
            env["MASTER_ADDR"] = self.master_addr
        return env


def expand_hostlist(spec: str) -> list[str]:
    """Expand a SLURM host list: ``"node[01-03,07],gpu5"`` -> ``["node01", "node02", "node03", "node07", "gpu5"]``.

    Ranges keep their zero padding; several bracket groups in one name expand as a product
    (``"r[1-2]n[1-2]"`` -> ``r1n1, r1n2, r2n1, r2n2``).

    Raises:
        LaunchEnvError: unbalanced brackets or a malformed range (the message quotes the list).
    """
    hosts: list[str] = []
    for item in _split_top_level(spec):
        hosts.extend(_expand_one(item, spec))
    return hosts


def _split_top_level(spec: str) -> list[str]:
    items: list[str] = []
    current: list[str] = []
    depth = 0
    for char in spec.strip():
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise LaunchEnvError(f"malformed SLURM host list {spec!r}: unbalanced brackets")
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise LaunchEnvError(f"malformed SLURM host list {spec!r}: unbalanced brackets")
    items.append("".join(current))
    return [item for item in (i.strip() for i in items) if item]


def _expand_one(name: str, spec: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", name)
    if match is None:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    expanded: list[str] = []
    for part in match.group(1).split(","):
        bounds = part.strip().split("-")
        if len(bounds) == 1 and bounds[0].isdigit():
            values = [bounds[0]]
        elif len(bounds) == 2 and all(b.isdigit() for b in bounds) and int(bounds[0]) <= int(bounds[1]):
            width = len(bounds[0])
            values = [str(v).zfill(width) for v in range(int(bounds[0]), int(bounds[1]) + 1)]
        else:
            raise LaunchEnvError(f"malformed SLURM host list {spec!r}: bad range {part!r}")
        expanded.extend(head + value for value in values)
    return [host for prefix in expanded for host in _expand_one(prefix + tail, spec)]


def _int_var(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name].split("(", 1)[0]  # SLURM_NTASKS_PER_NODE may read "4(x2)"
    try:
        return int(raw)
    except ValueError:
        raise LaunchEnvError(f"{name}={environ[name]!r} is not an integer") from None


def _read(launcher: LauncherVars, environ: Mapping[str, str]) -> LaunchEnv | None:
    """This launcher's layout, ``None`` when none of its rank variables is set, an error when half of them are."""
    size_name = next((name for name in launcher.world_size if name in environ), None)
    has_rank = launcher.rank in environ
    if not has_rank and size_name is None:
        return None
    if launcher is SLURM and not has_rank:
        return None  # an allocation shell (sbatch/salloc), not a task started by srun
    missing = [] if has_rank else [launcher.rank]
    if size_name is None:
        missing.append(" or ".join(launcher.world_size))
    if launcher.local_rank_required and launcher.local_rank not in environ:
        missing.append(launcher.local_rank)
    if missing or size_name is None:  # size_name is None only when missing already names it
        present = sorted(n for n in (launcher.rank, *launcher.world_size, launcher.local_rank) if n in environ)
        raise LaunchEnvError(
            f"incomplete {launcher.name} environment: {', '.join(present)} set but {', '.join(missing)} missing. "
            "Start every process with the launcher (torchrun, deepspeed, mpirun, srun), or export RANK, "
            "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT yourself; unset the stray variables to run a "
            "single process"
        )
    rank, world = _int_var(environ, launcher.rank), _int_var(environ, size_name)
    if not 0 <= rank < world:
        raise LaunchEnvError(f"{launcher.rank}={rank} is not a valid rank for {size_name}={world}")
    local_rank = _int_var(environ, launcher.local_rank) if launcher.local_rank in environ else rank
    local_size = world
    if launcher.local_size is not None and launcher.local_size in environ:
        local_size = _int_var(environ, launcher.local_size)
    return LaunchEnv(launcher, rank, world, local_rank, local_size, _master_addr(launcher, environ, world, local_size))


def _master_addr(launcher: LauncherVars, environ: Mapping[str, str], world: int, local_size: int) -> str | None:
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"]
    if launcher is SLURM:
        nodelist = next((environ[n] for n in SLURM_NODELISTS if environ.get(n)), None)
        if nodelist is not None:
            return expand_hostlist(nodelist)[0]  # srun places task 0 on the first host of the list
        if environ.get(SLURM_LAUNCH_ADDR):
            return environ[SLURM_LAUNCH_ADDR]
    if world == 1 or local_size >= world:
        return "127.0.0.1"
    return None


def detect(environ: Mapping[str, str], tool_first: bool = False) -> LaunchEnv | None:
    """The launcher that started this process, or ``None`` when no launcher's variables are present.

    Args:
        environ: the environment to read (``os.environ``).
        tool_first: look at MPI/SLURM names before torch's. The per-rank shim wants this (``srun --export=ALL``
            copies the launching shell's environment, which may hold a stale ``RANK``); ``init_distributed``
            does not (torchrun started inside a SLURM allocation sets ``RANK`` for each of its workers).

    Raises:
        LaunchEnvError: the first launcher with any variable present is missing some it needs.
    """
    order = (*TOOLS, TORCH) if tool_first else (TORCH, *TOOLS)
    for launcher in order:
        found = _read(launcher, environ)
        if found is not None:
            return found
    return None
