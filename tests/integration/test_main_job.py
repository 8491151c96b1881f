"""The main job's script (``examples/train_gpt.py``, what ``scripts/run_main.sh`` runs) through the ``deepspeed``
launcher on 2 CPU ranks, shrunk to a few steps: it must exit 0 (the held-out loss fell), print the per-phase memory
table and write metrics.json with a falling held-out loss and memory records next to the ZeRO-3 floor, and the PNG.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.launcher._launch import REPO, clean_env, free_port


def test_train_gpt_small_run(tmp_path: Path) -> None:
    out = tmp_path / "main"
    argv = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        "examples/train_gpt.py",
        "--deepspeed_config",
        "examples/ds_config_gpt_zero3.json",
        "--steps",
        "8",
        "--eval_every",
        "4",
        "--layers",
        "1",
        "--dim",
        "64",
        "--out",
        str(out),
    ]
    done = subprocess.run(argv, cwd=REPO, env=clean_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "ZeRO stage 3 over 2 CPU process(es)" in done.stdout and "memory per phase" in done.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    val = [h["val_loss"] for h in metrics["history"]]
    assert [h["step"] for h in metrics["history"]] == [0, 4, 8] and val[-1] < val[0]
    phases = metrics["memory_per_phase"]
    assert {"after forward", "after backward", "after step"} <= set(phases)
    # On CPU the figure is the tensors the engine holds: after backward that is this rank's share of the
    # parameters, gradients and Adam moments, which is the ZeRO-3 floor ((4 + 4 + 8) bytes x parameters / 2 ranks
    # in fp32), plus the engine's buffers.
    assert metrics["memory_measure"] == "tensors held by the engine"
    floor = phases["after backward"]["floor_gib"]
    assert 0 < floor <= phases["after backward"]["largest_gib"] < 4 * floor
    records = [r for r in metrics["records"] if r["phase"] == "after step"]
    assert len(records) == 8 and len({round(r["gib"], 6) for r in records[1:]}) == 1  # flat from step 2 on
    assert (out / "memory_phases.png").stat().st_size > 10_000
