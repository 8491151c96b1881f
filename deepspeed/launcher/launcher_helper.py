"""Per-rank shim for MPI and SLURM launches: map the tool's rank variables, then exec the user program.

``mpirun``/``srun`` start every rank themselves, each with its own variables (``OMPI_COMM_WORLD_RANK``,
``PMI_RANK``, ``SLURM_PROCID`` ...). This module sets the names DeepSpeed and torch read (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, LOCAL_WORLD_SIZE) and replaces itself with the user's program
(``exec``: no extra process stays around, and signals reach the program directly).

Usage: ``python -u -m deepspeed.launcher.launcher_helper --launcher L [--module|--no_python] script args``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

# Sources per variable, first match wins: Open MPI, MPICH/Intel MPI (PMI), PMIx, MVAPICH2, SLURM.
RANK_SOURCES: dict[str, tuple[str, ...]] = {
    "RANK": ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID"),
    "WORLD_SIZE": ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS"),
    "LOCAL_RANK": ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"),
    "LOCAL_SIZE": (
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "MPI_LOCALNRANKS",
        "MV2_COMM_WORLD_LOCAL_SIZE",
        "SLURM_NTASKS_PER_NODE",
    ),
}


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the helper's command line (the user's arguments are kept verbatim)."""
    parser = argparse.ArgumentParser(description="DeepSpeed per-rank shim for MPI/SLURM launches")
    parser.add_argument("--launcher", type=str.lower, default="mpich", help="launcher that started this rank")
    parser.add_argument("--module", action="store_true", help="run user_script as a Python module (python -m)")
    parser.add_argument("--no_python", action="store_true", help="run user_script directly, not through Python")
    parser.add_argument("user_script", type=str, help="program (or module) to run")
    parser.add_argument("user_args", nargs=argparse.REMAINDER, help="arguments passed unchanged to the program")
    return parser.parse_args(args)


def rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` plus RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_SIZE/LOCAL_WORLD_SIZE taken from the tool's variables.

    The tool's values win over inherited ones: ``srun --export=ALL`` copies the launching shell's
    environment, which may hold a stale RANK.
    """
    env = dict(environ)
    for target, sources in RANK_SOURCES.items():
        value = next((environ[name] for name in sources if name in environ), None)
        if value is not None:
            # SLURM_NTASKS_PER_NODE may read "4(x2)"; the count is the leading number.
            env[target] = value.split("(", 1)[0]
    if "LOCAL_SIZE" in env:
        env["LOCAL_WORLD_SIZE"] = env["LOCAL_SIZE"]
    return env


def program_argv(args: argparse.Namespace, python: str) -> list[str]:
    """The argv that replaces this process."""
    if args.no_python:
        return [args.user_script, *args.user_args]
    return [python, "-u", *(["-m"] if args.module else []), args.user_script, *args.user_args]


def main(args: Sequence[str] | None = None) -> None:
    """Map the rank variables and exec the user's program; does not return."""
    opts = parse_args(args)
    if opts.module and opts.no_python:
        sys.exit("launcher_helper: --module and --no_python are mutually exclusive")
    argv = program_argv(opts, sys.executable)
    os.execvpe(argv[0], argv, rank_env(os.environ))


if __name__ == "__main__":
    main()
