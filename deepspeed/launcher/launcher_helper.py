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

from deepspeed._foundation import launch_env


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
    environment, which may hold a stale RANK. ``MASTER_ADDR`` is left as the launcher exported it.

    Raises:
        LaunchEnvError: the tool's variables are incomplete (the message names the missing ones).
    """
    env = dict(environ)
    found = launch_env.detect(environ, tool_first=True)
    if found is not None:
        mapped = found.torch_env()
        mapped.pop("MASTER_ADDR", None)
        env.update(mapped)
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
