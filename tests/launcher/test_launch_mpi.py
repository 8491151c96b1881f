"""``mpirun -np 2`` (Open MPI, no mpi4py) starts two CPU ranks of ``fixtures/train_step.py``; they must come up as
ranks 0 and 1 of a world of 2 from the ``OMPI_COMM_WORLD_*`` variables alone and take a step equal to the
single-process reference. Open MPI is installed from Debian's packages when ``mpirun`` is missing and we are root;
if that fails the test is skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher._launch import TRAIN_STEP, assert_trained_world, clean_env, free_port, run_all


def _mpirun() -> str:
    """Path of Open MPI's mpirun, installing Debian's openmpi-bin when missing (skips when that fails)."""
    found = shutil.which("mpirun")
    if found is None and hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        cmd = ["apt-get", "install", "-y", "--no-install-recommends", "openmpi-bin"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            update = subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True, timeout=300)
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                reason = (done.stderr or update.stderr).strip().splitlines()[-1:]
                pytest.skip(f"mpirun missing and `apt-get install openmpi-bin` failed: {reason}")
        found = shutil.which("mpirun")
    if found is None:
        pytest.skip("mpirun not installed (Open MPI's openmpi-bin) and not root to install it")
    version = subprocess.run([found, "--version"], capture_output=True, text=True).stdout
    if "Open MPI" not in version:
        pytest.skip(f"mpirun is not Open MPI: {version.strip()[:80]}")
    return found


def test_mpirun_two_ranks_without_mpi4py(tmp_path: Path) -> None:
    mpirun = _mpirun()
    env = clean_env(tmp_path, MASTER_PORT=str(free_port()))
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    exports = [
        arg
        for name in ("DS_ACCELERATOR", "REPORT_DIR", "PYTHONPATH", "MASTER_PORT", "OMP_NUM_THREADS")
        for arg in ("-x", name)
    ]
    argv = [
        mpirun,
        *root,
        "--oversubscribe",
        "-np",
        "2",
        "--mca",
        "btl",
        "self,tcp",
        *exports,
        sys.executable,
        "-u",
        TRAIN_STEP,
    ]
    run_all([(argv, env)])
    got = assert_trained_world(tmp_path)
    assert [(r["local_rank"], r["master_addr"]) for r in got] == [(0, "127.0.0.1"), (1, "127.0.0.1")]
