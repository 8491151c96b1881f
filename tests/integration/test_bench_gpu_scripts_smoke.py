"""CPU smoke test of the one-process GPU benchmark scripts (long sequences, SP over a fake group, largest model).

They measure on a GPU (``benchmarks/gpu_figures.sh``); here each runs on the tiny Qwen2-shaped model so that a
change to the engine or to ``benchmarks/models.py`` that breaks them shows up before a GPU call is spent on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), "MASTER_PORT": "29731"}
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


def test_long_context_rows_record_each_length(tmp_path: Path) -> None:
    """Every length gets a record in increasing order, the warm-up step first, with the ALST switches applied."""
    out = tmp_path / "lc.jsonl"
    done = _run(
        [
            str(BENCH / "long_context_gpu.py"),
            "--model",
            "quick-qwen",
            "--tile-mlp",
            "2",
            "--tile-loss",
            "4",
            "--act-offload",
            "--warmup-seq",
            "32",
            "--lengths",
            "128,64",
            "--out",
            str(out),
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["seq"], r["status"]) for r in records] == [(32, "warmup"), (64, "ok"), (128, "ok")]
    assert all(r["row"] == "ours:mlp2:loss4:offload" and r["loss"] > 0 for r in records)
    # The decoder layers' inputs were marked for the offloader (on a CPU it keeps them where they are).
    assert records[-1]["offload_stats"]["marked_tensors"] >= 1


def test_sp_fake_group_rows_are_one_ranks_share(tmp_path: Path) -> None:
    """Rank 0 of a fake 8-rank group: the engine runs SP=8 with ZeRO-3 over the 8 ranks, each step feeds the rank
    1/8 of the tokens, and the exchange gives its core attention the whole sequence."""
    out = tmp_path / "sp.jsonl"
    args = ["--model", "quick-qwen", "--heads", "8", "--tile-mlp", "2", "--tile-loss", "4", "--act-offload"]
    done = _run([str(BENCH / "sp_fake_group_gpu.py"), *args, "--lengths", "128,64", "--out", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["seq"], r["seq_per_rank"], r["status"]) for r in records] == [(64, 8, "ok"), (128, 16, "ok")]
    for r in records:
        assert (r["engine_sp"], r["zero_world_size"], r["world_size"]) == (8, 8, 8)
        assert r["params"] / 8 <= r["param_shard_numel"] < r["params"] / 8 + 1024  # ZeRO-3 shards over all 8
        assert r["attn_tokens"] == r["seq"]  # the all-to-all turned 1/8 of the tokens into the whole sequence
        assert r["offload_stats"]["marked_tensors"] >= 1
        assert r["floor_gib"] == pytest.approx(sum(r["floor_parts_gib"].values()), abs=1e-5)
    small, large = (r["floor_parts_gib"] for r in records)
    assert small["states"] == large["states"] and small["activations"] < large["activations"]


def test_largest_model_trial_reports_its_size(tmp_path: Path) -> None:
    """One trial trains one step of the model with the asked layer count and reports its parameter count."""
    done = _run(
        [
            str(BENCH / "largest_model_gpu.py"),
            "--trial",
            "--model",
            "quick-qwen",
            "--layers",
            "3",
            "--seq",
            "32",
            "--states",
            "bf16",
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    sys.path.insert(0, str(BENCH))
    import dataclasses

    from models import MODELS

    assert record["params"] == dataclasses.replace(MODELS["quick-qwen"], layers=3).num_params()
