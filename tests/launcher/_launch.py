"""Start real processes the way a launcher would and collect the reports of ``fixtures/train_step.py``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN_STEP = str(Path(__file__).parent / "fixtures" / "train_step.py")
TIMEOUT = 150  # seconds for a whole launch: a loaded 2-core machine imports torch slowly
# Variables a launcher sets; removed from the inherited environment so each test starts clean.
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "ROLE_RANK",
    "TORCHELASTIC_RUN_ID",
)


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(report_dir: Path, **extra: str) -> dict[str, str]:
    """The current environment without launcher, SLURM or MPI variables, plus the fixture's settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_"))
    }
    env.update(
        DS_ACCELERATOR="cpu",
        REPORT_DIR=str(report_dir),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])),
    )
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(extra)
    return env


def run_all(commands: list[tuple[list[str], dict[str, str]]], timeout: float = TIMEOUT) -> list[subprocess.Popen]:
    """Start every ``(argv, env)`` at once (they rendezvous with each other) and wait for all of them.

    Raises:
        AssertionError: a process failed or ran past ``timeout``; the message holds every output.
    """
    procs = [
        subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for argv, env in commands
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [i for i, proc in enumerate(procs) if proc.returncode != 0]
    assert not failed, "\n".join(f"--- process {i} exited {procs[i].returncode}\n{outputs[i][-3000:]}" for i in failed)
    return procs


def reports(report_dir: Path, world: int) -> list[dict]:
    """The per-rank reports, in rank order; asserts one per rank."""
    found = sorted(p.name for p in report_dir.glob("rank*.json"))
    assert found == sorted(f"rank{r}.json" for r in range(world)), found
    return [json.loads((report_dir / f"rank{r}.json").read_text()) for r in range(world)]


def assert_trained_world(report_dir: Path, world: int = 2) -> list[dict]:
    """Ranks 0..world-1 of one world trained a step that matches the single-process reference."""
    got = reports(report_dir, world)
    assert [(r["rank"], r["world_size"]) for r in got] == [(i, world) for i in range(world)]
    for r in got:
        assert r["max_abs_diff"] < 1e-6, r
    return got


def python_step(*args: str) -> list[str]:
    """argv running the fixture with this interpreter."""
    return [sys.executable, "-u", TRAIN_STEP, *args]
