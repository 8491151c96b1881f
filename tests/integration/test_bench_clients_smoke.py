"""``benchmarks/clients/run_gpu.sh --smoke`` on the CPU: both scripts run, write their records and pass; without
Lightning the full mode records the import error per strategy instead of crashing."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_run_gpu_smoke(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path))
    env.pop("DS_ACCELERATOR", None)
    done = subprocess.run(
        ["bash", "benchmarks/clients/run_gpu.sh", "--smoke"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    check = json.loads((tmp_path / "cuda_import_check.jsonl").read_text().splitlines()[-1])
    assert check["mode"] == "smoke" and check["initialized_after_import"] is False and check["ok"] is True
    lightning = json.loads((tmp_path / "lightning.jsonl").read_text().splitlines()[-1])
    assert lightning["mode"] == "smoke" and lightning["ok"] and len(lightning["losses"]) == 18
    assert not (tmp_path / "lightning_work").exists()


@pytest.mark.skipif(importlib.util.find_spec("lightning") is not None, reason="lightning is installed")
def test_full_mode_without_lightning_records_why(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "benchmarks/clients/lightning_gpu.py", "--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 1
    records = [json.loads(line) for line in (tmp_path / "lightning.jsonl").read_text().splitlines()]
    assert [r["strategy"] for r in records] == ["deepspeed_stage_2", "deepspeed_stage_3"]
    assert all(not r["ok"] and "lightning" in r["error"] for r in records)
