"""CPU smoke test of ``benchmarks/profile_phases.py`` (the per-phase step profile, ours vs FSDP2 at 8192 tokens on
the GPU: ``bash benchmarks/diag/run_profile_8192.sh``).

On the CPU it only checks that the script runs ours ZeRO-3 on ``quick-qwen`` with a micro-batch and a sequence
override, profiles the requested number of whole steps, writes ``<impl>_z<stage>_<tokens>tok.json`` with a
``summary`` whose counts are non-negative integers and whose device fields are None without CUDA, and that
``--compare`` renders the side-by-side table (stdout and ``--md``); the interval arithmetic is checked directly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
SCRIPT = BENCH / "profile_phases.py"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


def _run(args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(23000 + os.getpid() % 2000),
    )
    cmd = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(cmd, cwd="/tmp", env=env, capture_output=True, text=True, timeout=timeout, check=False)


def _counts(node: object, path: str = "") -> list[tuple[str, object]]:
    """Every ``count`` field (and the top-level launch / sync counters) of a summary, with its path."""
    out: list[tuple[str, object]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("count", "kernel_launches", "blocking_sync_calls", "scalar_reads", "device_events"):
                out.append((f"{path}.{key}", value))
            elif key != "matched":
                out += _counts(value, f"{path}.{key}")
    return out


def test_merge_intervals_and_gaps() -> None:
    """Overlapping and touching [start, end) intervals merge; empty ones drop out."""
    from profile_phases import _clip, _length, merge_intervals

    merged = merge_intervals([(5.0, 7.0), (0.0, 2.0), (1.0, 3.0), (3.0, 4.0), (9.0, 9.0), (6.0, 6.5)])
    assert merged == [(0.0, 4.0), (5.0, 7.0)]
    assert _length(merged) == 6.0
    assert _clip(merged, 1.0, 6.0) == [(1.0, 4.0), (5.0, 6.0)]


def test_profile_ours_zero3_quick_qwen_and_compare(tmp_path: Path) -> None:
    spec = {
        "impl": "ours",
        "stage": 3,
        "dtype": "bf16",
        "model": "quick-qwen",
        "micro_batch": 2,
        "seq": 16,
        "warmup": 1,
        "steps": 1,
        "profile_steps": 2,
        "ds_config": "hf_auto",
        "cprofile": True,
    }
    proc = _run(["--out", str(tmp_path), "--spec", json.dumps(spec)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    path = tmp_path / "ours_z3_32tok.json"  # 2 x 16 tokens
    assert path.exists(), sorted(p.name for p in tmp_path.iterdir())
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["file"] == path.name and line["busy_fraction"] is None

    record = json.loads(path.read_text())
    assert record["tokens_per_step"] == 32 and record["model_config"]["seq"] == 16
    python = record["python_profile"]  # our own functions show up, by file and line
    assert python["steps"] == 2 and python["by_self"] and python["by_cumulative"]
    assert any(row["function"].startswith("params/manager.py:") for row in python["by_cumulative"]), python
    memory = record["memory"]  # the allocator counters read 0 without CUDA; the keys are there for the table
    assert set(memory) == {"alloc_at_step_start_gib", "peak_alloc_gib", "peak_reserved_gib", "alloc_retries"}
    assert all(value == 0 for value in memory.values())
    summary = record["summary"]
    for key in (
        "profiled_steps",
        "wall_ms",
        "device_busy_ms",
        "busy_fraction",
        "gaps",
        "syncs",
        "blocking_sync_calls",
        "blocking_host_ms",
        "scalar_reads",
        "kernel_launches",
        "ops",
        "copy_kernels",
        "nccl_kernels",
        "phases",
    ):
        assert key in summary, key
    assert summary["profiled_steps"] == 2 and summary["has_device"] is False
    assert summary["wall_ms"] > 0 and summary["device_busy_ms"] is None and summary["busy_fraction"] is None
    for name in ("cudaStreamSynchronize", "aten::item", "aten::_local_scalar_dense", "cudaMemcpy (sync)"):
        assert name in summary["syncs"]
    for name in ("aten::slice", "aten::copy_", "aten::cat", "AccumulateGrad", "hook_nodes", "record_param_comms"):
        assert name in summary["ops"]
    counts = _counts(summary)
    assert len(counts) > 15
    for where, value in counts:
        assert isinstance(value, int) and not isinstance(value, bool) and value >= 0, (where, value)
    assert summary["ops"]["AccumulateGrad"]["count"] > 0  # the host side is profiled on the CPU too
    assert summary["gaps"]["count"] == 0 and summary["kernel_launches"] == 0
    assert set(summary["phases"]) == {"forward", "backward", "step"}
    assert all(row["host_ms"] > 0 and row["busy_in_window_ms"] is None for row in summary["phases"].values())

    other = dict(record, spec=dict(record["spec"], impl="fsdp2"))
    other["summary"] = dict(summary, wall_ms=summary["wall_ms"] * 2)
    (tmp_path / "fsdp2.json").write_text(json.dumps(other))
    md = tmp_path / "compare.md"
    cmp = _run(["--compare", str(path), str(tmp_path / "fsdp2.json"), "--md", str(md)], timeout=60)
    assert cmp.returncode == 0, cmp.stderr[-3000:]
    assert "| field | ours z3 | fsdp2 z3 | ratio |" in cmp.stdout
    assert "| wall_ms |" in cmp.stdout and "| 0.50 |" in cmp.stdout
    assert "| ops.aten::copy_.count |" in cmp.stdout and ".matched" not in cmp.stdout
    assert "| memory.peak_alloc_gib |" in cmp.stdout and "| median_s.step |" in cmp.stdout
    assert md.read_text() == cmp.stdout
