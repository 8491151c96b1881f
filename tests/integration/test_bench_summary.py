"""CPU tests of the benchmark record (``benchmarks/summary.py``), its page (``benchmarks/report.py``) and the floors.

The committed ``benchmarks/results/summary.json`` must be what ``summary.py`` makes of the committed raw records,
``docs/benchmarks.md`` what ``report.py`` makes of the summary, every row must say where and when it was measured
and carry a runner command that reproduces its record's configuration, and the page must speak without internal
labels.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
RESULTS = BENCH / "results"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import floors  # noqa: E402 - importable once BENCH is on sys.path
import report  # noqa: E402
import run_all  # noqa: E402
import summary  # noqa: E402


def _committed() -> dict:
    return json.loads((RESULTS / "summary.json").read_text())


def test_rows_have_exactly_the_keys_and_provenance() -> None:
    data = _committed()
    assert data["rows"] and set(data["methods"]) == {r["family"] for r in data["rows"]}
    for row in data["rows"]:
        assert tuple(row) == summary.ROW_KEYS, row
        assert row["engine"] in summary.ENGINES, row
        assert all(row[k] is None or isinstance(row[k], float) for k in summary.FIGURES), row
        assert row["measured_on"] and re.fullmatch(r"\d{4}-\d\d-\d\d", row["measured_at"]), row
        assert row["command"].startswith("python benchmarks/run_all.py --scenario "), row
    keys = [(r["scenario"], r["engine"]) for r in data["rows"]]
    assert len(set(keys)) == len(keys)


def test_committed_summary_is_regenerated_from_the_raw_records() -> None:
    assert (RESULTS / "summary.json").read_text() == summary.dumps(summary.rows(summary.stored()))
    stored = summary.stored()
    assert len(stored) == len(_committed()["rows"])  # one record per row: the rest is history


def test_docs_page_is_up_to_date_and_follows_the_summary() -> None:
    docs = (REPO / "docs" / "benchmarks.md").read_text()
    data = _committed()
    assert report.render(data) == docs, "docs/benchmarks.md is stale: run python benchmarks/report.py"
    assert docs.count("<!-- figures:begin -->") == 1 and docs.count("<!-- figures:end -->") == 1
    rows = data["rows"]
    edited = {**data, "rows": [dict(rows[0], peak_alloc_gib=(rows[0]["peak_alloc_gib"] or 0) + 1.0), *rows[1:]]}
    assert report.render(edited) != docs


def test_docs_page_uses_no_internal_labels() -> None:
    docs = (REPO / "docs" / "benchmarks.md").read_text()
    for label in (r"\breport \d", r"\bcalls? \d", r"acceptance", r"\bparked\b", r"fake N=", r"gpu_run", r"diag/"):
        assert not re.search(label, docs, flags=re.IGNORECASE), label
    for term in ("Model-state floor", "Simulated world size", "DeepSpeed 0.19.8", "FSDP2"):
        assert term in docs, term


@pytest.mark.parametrize("family", ["s1", "s2", "s3", "throughput"])
def test_commands_reproduce_the_records(family: str) -> None:
    """Each stored worker record's command, parsed by the runner, yields a spec with the record's configuration."""
    for record in summary.read_records(RESULTS / f"{family}.jsonl"):
        argv = shlex.split(record["command"])[2:]
        args = run_all.parse_args([a if a != "OUT" else "/tmp/unused" for a in argv])
        (spec,) = run_all.specs(args)
        for key in (*run_all.SPEC_KEYS, "impl", "tag"):
            if key in record and not (key == "trace" and not isinstance(record[key], bool)):
                want = record[key]
                if key == "checkpoint_reentrant" and key not in spec:
                    spec[key] = summary._default_reentrant(spec)
                assert spec.get(key, want if want in (None, False) else "missing") == want, (key, record["command"])


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
        "params": 3_000_000_000,
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
        "measured_on": "NVIDIA H200",
        "measured_at": "2026-12-01",
        "command": "python benchmarks/run_all.py --scenario s3 --impl x --out OUT",
    }
    return {**rec, **extra}


def test_synthetic_records_map_to_the_documented_names() -> None:
    for impl in ("ours", "fsdp2", "upstream", "plain"):
        assert (
            summary.scenario_name(_s3(impl, stage=None if impl in ("fsdp2", "plain") else 3)) == "s3_3b_zero3_8192tok"
        )
    assert summary.scenario_name(_s3("ours_leanoff")) == "s3_3b_zero3_8192tok_leanoff"
    assert summary.scenario_name(_s3("ours", tag="blocksoff")) == "s3_3b_zero3_8192tok_blocksoff"
    assert summary.scenario_name(_s3("ours", checkpoint_reentrant=True)) == "s3_3b_zero3_8192tok_reentrant"
    assert summary.scenario_name(_s3("ours", offload=True, offload_param=True)) == "s3_3b_zero3_8192tok_offload_param"
    s1 = {"scenario": "s1", "impl": "ours_leanoff", "stage": 2, "dtype": "fp16", "gas": 16, "world_size": 1}
    assert summary.scenario_name({**s1, "model": "gpt1.3b", "tokens_per_step": 16 * 2048}) == (
        "s1_1.3b_zero2_fp16_2048tok_gas16_leanoff"
    )
    assert summary.scenario_name({"config": "host_s3", "impl": "before", "model": "qwen2-3b"}) is None
    assert summary.scenario_name({"backend": "nccl", "stage": 3, "ok": True}) is None  # a parity check


def test_figures_floor_and_latest() -> None:
    """Figures of a record, its floor from floors.py, and the later of two records of one row wins."""
    row = summary.row_of(_s3("ours"))
    assert row["step_s"] == 0.5 and row["peak_alloc_gib"] == 50.0 and row["tokens_per_s"] == 16384.0
    assert row["floor_gib"] == round(16 * 3_000_000_000 / floors.GiB, 6)
    assert summary.row_of(_s3("ours", status="error"))["peak_alloc_gib"] is None
    skipped = _s3("ours", skipped_steps=3, warmup_steps=2)
    assert summary.every_step_skipped(skipped) and summary.row_of(skipped)["peak_alloc_gib"] is None
    older, newer = _s3("ours", peak_alloc_gib=40.0), _s3("ours", measured_at="2026-12-03")
    rows = summary.rows([newer, older, _s3("fsdp2")])
    assert [(r["engine"], r["peak_alloc_gib"], r["measured_at"]) for r in rows] == [
        ("ours", 50.0, "2026-12-03"),
        ("fsdp2", 50.0, "2026-12-01"),
    ]


def test_add_replaces_the_row_and_keeps_the_rest(tmp_path: Path) -> None:
    (tmp_path / "s3.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in (_s3("ours", peak_alloc_gib=40.0), _s3("fsdp2")))
    )
    new = [_s3("ours", measured_at="2026-12-05"), _s3("upstream", status="error")]
    assert summary.add(new, tmp_path) == 1
    stored = summary.read_records(tmp_path / "s3.jsonl")
    assert [(r["impl"], r["peak_alloc_gib"]) for r in stored] == [("fsdp2", 50.0), ("ours", 50.0)]
    data = json.loads(summary.write(tmp_path).read_text())
    assert [r["engine"] for r in data["rows"]] == ["ours", "fsdp2"] and set(data["methods"]) == {"s3"}


@pytest.mark.parametrize(
    "mode, n, expected",
    [
        (("ours", 0, False, False), 8, (16.0, 0.0)),
        (("ours", 1, False, False), 4, (7.0, 0.0)),
        (("ours", 2, False, False), 7, (4.0, 0.0)),
        (("ours", 2, True, False), 2, (3.0, 6.0)),
        (("ours", 3, False, False), 8, (2.0, 0.0)),
        (("ours", 3, True, False), 4, (1.0, 3.0)),
        (("ours", 3, True, True), 2, (1.0, 7.0)),
        (("fsdp2", None, False, False), 4, (4.0, 0.0)),
        (("fsdp2", None, True, False), 4, (0.0, 4.0)),
        (("plain", None, False, False), 1, (8.0, 0.0)),
    ],
)
def test_floor_formulas(mode: tuple, n: int, expected: tuple) -> None:
    impl, stage, offload, offload_param = mode
    assert floors.bytes_per_param(impl, stage, n, offload, offload_param) == expected
