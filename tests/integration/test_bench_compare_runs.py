"""benchmarks/compare_runs.py: rows match on configuration, moved memory fails, slow steps are flagged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "compare_runs.py"


def _row(peak: float, step: float, **over: object) -> dict:
    row = {
        "scenario": "s1",
        "impl": "ours",
        "stage": 2,
        "dtype": "bf16",
        "gas": 16,
        "world_size": 8,
        "model": "gpt1.3b",
        "offload": False,
        "offload_param": False,
        "status": "ok",
        "peak_alloc_gib": peak,
        "step_time_s": step,
    }
    row.update(over)
    return row


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(before: Path, after: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(before), str(after), *extra], capture_output=True, text=True, check=False
    )


def test_equal_memory_passes_and_ratio_is_reported(tmp_path: Path) -> None:
    before = _write(tmp_path / "b.jsonl", [_row(9.9, 2.0), _row(1.0, 1.0, stage=1)])
    after = _write(tmp_path / "a.jsonl", [_row(9.905, 2.1), _row(1.0, 1.0, stage=1, status="error")])
    out = _run(before, after, "--json", str(tmp_path / "c.json"))
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((tmp_path / "c.json").read_text())
    assert len(result["rows"]) == 1  # the errored row is not compared
    assert result["rows"][0]["step_time_s"]["slowdown"] == 1.05
    assert result["slower"] == []


def test_moved_memory_fails_and_slow_rows_are_flagged(tmp_path: Path) -> None:
    before = _write(tmp_path / "b.jsonl", [_row(9.9, 2.0)])
    after = _write(tmp_path / "a.jsonl", [_row(9.93, 2.5)])
    out = _run(before, after)
    assert out.returncode == 1
    assert "MEMORY" in out.stdout and "peak_alloc_gib +0.0300" in out.stdout
    assert "SLOWER" in out.stdout and "1.250x" in out.stdout
