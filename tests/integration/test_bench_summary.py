"""CPU tests of the benchmark summary (``benchmarks/summary.py``) and of the page generated from it.

The committed ``benchmarks/results/summary.json`` must be what ``summary.py`` makes of the committed raw records,
its rows must carry exactly the documented keys with one row per (scenario, engine, run), the scenario names must
follow the table in ``benchmarks/README.md``, and ``docs/benchmarks.md`` must be what the report command in
``benchmarks/results/COMMANDS.txt`` writes from those files, so editing one without regenerating the other fails.
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
RESULTS = BENCH / "results"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import report  # noqa: E402 - importable once BENCH is on sys.path
import summary  # noqa: E402

KEYS = [
    "scenario",
    "engine",
    "run",
    "step_s",
    "peak_alloc_gib",
    "peak_reserved_gib",
    "reserved_after_init_gib",
    "alloc_after_init_gib",
    "tokens_per_s",
]


def _committed() -> list[dict]:
    return json.loads((RESULTS / "summary.json").read_text())


def test_rows_have_exactly_the_keys() -> None:
    rows = _committed()
    assert rows, "summary.json is empty"
    for row in rows:
        assert list(row) == KEYS, row
        assert row["engine"] in ("ours", "fsdp2", "upstream"), row
        assert all(row[k] is None or isinstance(row[k], (int, float)) for k in KEYS[3:]), row


def test_scenario_names_unique_per_engine_and_run() -> None:
    rows = _committed()
    keys = [(r["scenario"], r["engine"], r["run"]) for r in rows]
    assert len(set(keys)) == len(keys), [k for k in keys if keys.count(k) > 1]


def test_committed_summary_is_regenerated_from_the_raw_records() -> None:
    """summary.json == ``python benchmarks/summary.py benchmarks/results`` (COMMANDS.txt), and every run it names
    is a results file that is still there."""
    assert (RESULTS / "summary.json").read_text() == summary.dumps(summary.summarize([RESULTS]))
    for run in {r["run"] for r in _committed()}:
        assert (RESULTS / f"{run}.jsonl").exists(), run
    assert (
        "python benchmarks/summary.py benchmarks/results --out benchmarks/results/summary.json"
        in (RESULTS / "COMMANDS.txt").read_text()
    )


def _s3(impl: str, **extra: object) -> dict:
    """A synthetic S3 record: Qwen2-3B, micro-batch 4 x seq 2048 (8192 tokens), world size 1."""
    rec = {
        "scenario": "s3",
        "impl": impl,
        "stage": None if impl == "fsdp2" else 3,
        "dtype": "bf16",
        "gas": 1,
        "world_size": 1,
        "model": "qwen2-3b",
        "offload": False,
        "offload_param": False,
        "micro_batch": 4,
        "checkpoint_reentrant": impl == "upstream",
        "status": "ok",
        "tokens_per_step": 8192,
        "model_cfg": {"seq": 2048},
        "step_time_s": 0.5,
        "peak_alloc_gib": 50.0,
        "peak_reserved_gib": 52.0,
        "alloc_after_init_gib": 17.0,
        "reserved_after_init_gib": 18.0,
    }
    return {**rec, **extra}


def test_synthetic_records_map_to_the_documented_names() -> None:
    """The README's examples: the engines of one configuration share its name; each switch adds its part."""
    for impl in ("ours", "fsdp2", "upstream"):
        assert summary.scenario_name(_s3(impl)) == "s3_3b_zero3_8192tok", impl
    assert summary.scenario_name(_s3("ours_leanoff")) == "s3_3b_zero3_8192tok_leanoff"
    assert summary.scenario_name(_s3("ours", checkpoint_reentrant=True)) == "s3_3b_zero3_8192tok_reentrant"
    # A configuration that never ran records its spec only: the same name from the spec.
    spec_only = {
        k: v
        for k, v in _s3("ours").items()
        if k in ("scenario", "impl", "stage", "dtype", "gas", "world_size", "model", "offload", "micro_batch")
    }
    assert (
        summary.scenario_name(
            dict(spec_only, model="qwen2.5-7b", micro_batch=1, world_size=8, offload=True, status="not_run")
        )
        == "s3_7b_zero3_512tok_n8_offload"
    )
    assert summary.scenario_name(_s3("ours", offload=True, offload_param=True)) == "s3_3b_zero3_8192tok_offload_param"
    s1 = {
        "scenario": "s1",
        "impl": "ours_leanoff",
        "stage": 2,
        "dtype": "fp16",
        "gas": 16,
        "world_size": 1,
        "model": "gpt1.3b",
        "tokens_per_step": 16 * 2048,
        "status": "ok",
    }
    assert summary.scenario_name(s1) == "s1_1.3b_zero2_fp16_2048tok_gas16_leanoff"
    tp = {
        "scenario": "throughput",
        "impl": "upstream",
        "stage": 3,
        "dtype": "bf16",
        "gas": 1,
        "world_size": 1,
        "model": "gpt1.3b",
        "checkpoint_reentrant": True,
        "model_cfg": {"seq": 2048},
    }
    fsdp2 = dict(tp, impl="fsdp2", stage=None, checkpoint_reentrant=False)
    assert summary.scenario_name(tp) == summary.scenario_name(fsdp2) == "tp_1.3b_zero3_2048tok"
    assert (
        summary.scenario_name({"config": "report3_fp32", "impl": "ours", "model": "qwen2-3b"})
        == "init_3b_zero3_fp32_512tok_offload_builthost"
    )
    assert summary.scenario_name({"config": "report3_fp32", "impl": "before", "model": "qwen2-3b"}) is None
    assert summary.scenario_name({"backend": "nccl", "stage": 3, "ok": True}) is None  # a parity check


def test_distinct_configurations_get_distinct_names() -> None:
    base = _s3("ours")
    variants = [
        base,
        _s3("ours_leanoff"),
        _s3("ours", stage=2),
        _s3("ours", dtype="fp16"),
        _s3("ours", gas=4, tokens_per_step=4 * 8192),
        _s3("ours", world_size=8),
        _s3("ours", offload=True),
        _s3("ours", offload=True, offload_param=True),
        _s3("ours", model="qwen2.5-7b"),
        _s3("ours", micro_batch=1, tokens_per_step=2048),
        _s3("ours", scenario="s1"),
    ]
    names = [summary.scenario_name(v) for v in variants]
    assert len(set(names)) == len(names), names


def test_figures_rerun_and_clash() -> None:
    """Figures per scenario; a later record of one configuration replaces the earlier one; two configurations
    that would share a name raise instead of being merged."""
    rows = summary.rows_of([_s3("ours", status="error"), _s3("ours"), _s3("upstream")], "synthetic")
    assert [(r["scenario"], r["engine"]) for r in rows] == [
        ("s3_3b_zero3_8192tok", "ours"),
        ("s3_3b_zero3_8192tok", "upstream"),
    ]
    assert rows[0] == {
        "scenario": "s3_3b_zero3_8192tok",
        "engine": "ours",
        "run": "synthetic",
        "step_s": 0.5,
        "peak_alloc_gib": 50.0,
        "peak_reserved_gib": 52.0,
        "reserved_after_init_gib": 18.0,
        "alloc_after_init_gib": 17.0,
        "tokens_per_s": 16384.0,
    }
    failed = summary.rows_of([_s3("ours", status="not_run")], "synthetic")[0]
    assert all(failed[k] is None for k in KEYS[3:])
    s2 = {
        "scenario": "s2",
        "impl": "upstream",
        "stage": 1,
        "dtype": "bf16",
        "world_size": 1,
        "model": "gpt2.6b",
        "status": "ok",
        "init_peak_alloc_gib": 24.4,
        "init_peak_reserved_gib": 44.0,
        "alloc_after_init_gib": 24.4,
        "reserved_after_init_gib": 44.0,
        "first_step_peak_alloc_gib": 43.9,
    }
    row = summary.rows_of([s2], "synthetic")[0]
    assert row["scenario"] == "s2_2.6b_zero1_2048tok" and row["peak_alloc_gib"] == 24.4 and row["step_s"] is None
    # Same tokens from another shape: a different configuration the name cannot tell apart -> an error.
    with pytest.raises(ValueError, match="s3_3b_zero3_8192tok"):
        summary.rows_of([_s3("ours"), _s3("ours", micro_batch=2, seq=4096)], "synthetic")


def test_run_all_writes_the_summary_of_its_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's hook: DIR/summary.json holds the rows of DIR/results.jsonl, run named after the folder."""
    import run_all

    records = [_s3("ours"), _s3("fsdp2"), _s3("upstream", status="not_run")]
    monkeypatch.setattr(run_all, "run_jobs", lambda jobs, args, log: [dict(r) for r in records])
    out = tmp_path / "gpu_run99"
    with contextlib.redirect_stdout(io.StringIO()):
        assert run_all.main(["--out", str(out), "--quick", "--only", "s3", "--world-sizes", "1"]) == 0
    rows = json.loads((out / "summary.json").read_text())
    assert rows == summary.rows_of(records, "gpu_run99")
    assert {r["run"] for r in rows} == {"gpu_run99"} and len(rows) == 3
    assert "### `gpu_run99`" in (out / "benchmarks.md").read_text()


def _report_argv(md: Path) -> list[str]:
    """COMMANDS.txt's report.py command, writing to ``md`` and linking the committed plots without redrawing."""
    line = next(
        ln for ln in (RESULTS / "COMMANDS.txt").read_text().splitlines() if ln.startswith("python benchmarks/report.py")
    )
    argv = shlex.split(line)[2:]
    i = argv.index("--plots-dir")
    del argv[i : i + 2]
    argv[argv.index("--md") + 1] = str(md)
    return argv


def test_docs_page_is_up_to_date(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/benchmarks.md is exactly what the committed command writes from the committed records, NOTES.md and
    summary.json; its last section changes when a row of summary.json does (the check is not vacuous)."""
    monkeypatch.chdir(REPO)
    md = tmp_path / "benchmarks.md"
    with contextlib.redirect_stdout(io.StringIO()):
        assert report.main(_report_argv(md)) == 0
    docs = (REPO / "docs" / "benchmarks.md").read_text()
    assert md.read_text() == docs, "docs/benchmarks.md is stale: run the report command in COMMANDS.txt"
    rows = _committed()
    section = "\n".join(report.summary_section(rows)).rstrip()
    assert docs.rstrip().endswith(section)
    edited = [dict(rows[0], peak_alloc_gib=(rows[0]["peak_alloc_gib"] or 0) + 1.0), *rows[1:]]
    assert "\n".join(report.summary_section(edited)).rstrip() not in docs
