"""CPU tests of the benchmark suite's scheduler (``benchmarks/run_all.py``) and checkpoint-form bookkeeping.

The default GPU job list must fit one device call (the issue: "one device call runs the whole suite in under 10
minutes on one H200"): ``--plan`` with the defaults leaves nothing to the deadline and runs every configuration
but the three 7.6B N=1 offload rows the host-memory guard refuses. The real loop (prelaunch gates, thread shares,
one offload worker at a time) is exercised with a stand-in worker script that imports nothing heavy.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import run_all  # noqa: E402 - importable once BENCH is on sys.path


def _default_jobs(extra: list[str] | None = None) -> tuple[list, argparse.Namespace]:
    held: dict = {}
    real = run_all.print_plan
    run_all.print_plan = lambda jobs, args: held.update(jobs=jobs, args=args)
    try:
        run_all.main(["--out", "/tmp/unused_plan", "--world-sizes", "1,8", "--plan", *(extra or [])])
    finally:
        run_all.print_plan = real
    return held["jobs"], held["args"]


def test_default_plan_fits_one_device_call() -> None:
    """Every runnable configuration is scheduled, with a margin under the deadline; the offload rows never overlap."""
    jobs, args = _default_jobs()
    rows = run_all.plan(jobs, args)
    refused = [(j, note) for j, t, _, note in rows if t is None]
    assert all("host memory" in note for _, note in refused), refused
    assert sorted((j.spec["impl"], j.spec["model"], j.spec["world_size"], j.spec["offload"]) for j, _ in refused) == [
        ("fsdp2", "qwen2.5-7b", 1, True),
        ("ours", "qwen2.5-7b", 1, True),
        ("upstream", "qwen2.5-7b", 1, True),
    ]
    end = max(e for _, t, e, _ in rows if t is not None)
    assert end <= args.deadline_s - 40, end  # 470 s of the 510 s deadline: room for estimates that run long
    # The one-rank offload rows (tens of GiB of host memory each) run one at a time; the 7.6B fake-group ranks
    # with offload (1/8 of that) are ordinary jobs.
    offload = sorted((t, e) for j, t, e, _ in rows if t is not None and run_all.host_heavy(j.spec))
    assert len(offload) == 4
    assert sum(1 for j, t, _, _ in rows if t is not None and j.spec.get("offload") and j.spec["world_size"] == 8) == 3
    assert all(a_end <= b_start + 1e-9 for (_, a_end), (b_start, _) in itertools.pairwise(offload))
    solo_start = min(t for j, t, _, _ in rows if t is not None and j.solo)
    assert all(e <= solo_start + 1e-9 for j, t, e, _ in rows if t is not None and not j.solo)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run_all.print_plan(jobs, args)
    assert out.getvalue().splitlines()[-1].startswith("plan: 97 of 100 jobs run")


def test_checkpoint_form_defaults_and_override() -> None:
    """Upstream's S3 rows (and its ZeRO-3 throughput row) run reentrant by default; --s3-extra sets one form."""
    from _harness import default_checkpoint_reentrant

    assert default_checkpoint_reentrant({"impl": "upstream", "stage": 3})
    assert not default_checkpoint_reentrant({"impl": "upstream", "stage": 0})
    assert not default_checkpoint_reentrant({"impl": "upstream", "stage": 2})
    assert not default_checkpoint_reentrant({"impl": "fsdp2", "stage": None})
    assert not default_checkpoint_reentrant({"impl": "ours", "stage": 3})
    assert not default_checkpoint_reentrant({"impl": "upstream", "stage": 3, "checkpoint_reentrant": False})
    jobs, _ = _default_jobs()
    s3 = [j.spec for j in jobs if j.spec["scenario"] == "s3"]
    assert all(s["checkpoint_reentrant"] is (s["impl"] == "upstream") for s in s3)
    tp = {
        (j.spec["impl"], j.spec["stage"]): j.spec["checkpoint_reentrant"]
        for j in jobs
        if j.spec["scenario"] == "throughput"
    }
    assert tp[("upstream", 3)] is True and sum(tp.values()) == 1
    for value in (False, True):
        jobs, _ = _default_jobs(["--s3-extra", json.dumps({"checkpoint_reentrant": value})])
        assert all(j.spec["checkpoint_reentrant"] is value for j in jobs if j.spec["scenario"] == "s3")


def test_report_shows_the_checkpoint_form() -> None:
    """The S3 table has a ckpt column; the throughput table marks a reentrant row with a dagger."""
    import report

    base = {
        "scenario": "s3",
        "status": "ok",
        "stage": 3,
        "model": "qwen2-3b",
        "world_size": 1,
        "peak_alloc_gib": 9.0,
        "peak_reserved_gib": 10.0,
        "floor_gib": 8.0,
        "layers": 36,
    }
    rows = report.s3_table(
        [
            dict(base, impl="upstream", checkpoint_reentrant=True),
            dict(base, impl="ours"),
            dict(base, impl="fsdp2", stage=None, status="error", error="x"),
        ]
    )
    assert "| ckpt |" in rows[0]
    assert rows[0].count("|") == rows[1].count("|") == rows[2].count("|") == rows[3].count("|") == rows[4].count("|")
    assert any("| upstream | 3 | reentrant |" in r for r in rows)
    assert any("| ours | 3 | non-reentrant |" in r for r in rows)
    tp = {"scenario": "throughput", "status": "ok", "tokens_per_s": 5000.0, "peak_alloc_gib": 20.0, "stage": 3}
    table = report.throughput_table([dict(tp, impl="upstream", checkpoint_reentrant=True), dict(tp, impl="ours")])
    stage3 = next(r for r in table if r.startswith("| 3 |"))
    assert "5000 †" in stage3 and stage3.count("†") == 1


FAKE_WORKER = textwrap.dedent('''
    """Stand-in worker: the run_all protocol (--spec, --result, --gate) without torch."""
    import argparse, json, os, time
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec"); ap.add_argument("--result"); ap.add_argument("--gate", default="")
    a = ap.parse_args()
    spec = json.loads(a.spec)
    waited = None
    if a.gate:
        t = time.perf_counter()
        while not os.path.exists(a.gate):
            time.sleep(0.01)
        waited = time.perf_counter() - t
    start = time.time()
    time.sleep(spec.get("sleep", 0.3))
    rec = {**spec, "status": "ok", "gate_wait_s": waited, "t_start": start, "t_end": time.time(),
           "omp_env": os.environ.get("OMP_NUM_THREADS")}
    with open(a.result, "w") as f:
        json.dump(rec, f)
''')


def test_run_jobs_prelaunches_and_shares_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers started ahead wait at their gate; offload workers run one at a time with their own thread share."""
    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER)
    monkeypatch.setattr(run_all, "SCRIPTS", {k: worker for k in ("s1", "s2", "s3", "throughput")})
    args = argparse.Namespace(
        jobs=3,
        offload_threads=0,
        offload_jobs=1,
        prelaunch=3,
        mem_budget_gib=100.0,
        host_budget_gib=100.0,
        deadline_s=120.0,
        job_timeout_s=60.0,
        extra_site="",
        upstream_target=str(REPO),
    )

    def job(scenario: str, solo: bool = False, **spec: object) -> run_all.Job:
        return run_all.Job(
            spec={"scenario": scenario, "impl": "ours", "world_size": 1, "sleep": 0.4, **spec},
            est_s=2.0,
            est_gib=10.0,
            est_host_gib=4.0,
            solo=solo,
        )

    jobs = [
        job("s3", offload=True),
        job("s3", offload=True),
        *[job("s1", gas=g) for g in range(6)],
        job("throughput", solo=True),
        job("throughput", solo=True),
    ]
    t0 = time.time()
    records = run_all.run_jobs(jobs, args, tmp_path / "run_log.txt")
    assert time.time() - t0 < 60
    assert len(records) == len(jobs) and all(r["status"] == "ok" for r in records), records
    cores = os.cpu_count() or 2
    for r in records:
        want = (
            cores
            if r["scenario"] == "throughput"
            else (max(cores // 3, cores // 2) if r.get("offload") else max(1, cores // 3))
        )
        assert r["omp_threads"] == want and r["omp_env"] == str(want)
    prelaunched = [r for r in records if r["prelaunched_s"] > 0]
    assert len(prelaunched) >= len(jobs) - 3  # all but (at most) the first wave started before their turn
    assert any(r["gate_wait_s"] for r in prelaunched)  # and some of them waited at the gate
    off = sorted((r["t_start"], r["t_end"]) for r in records if r.get("offload"))
    assert off[0][1] <= off[1][0]  # --offload-jobs 1
    solo = sorted((r["t_start"], r["t_end"]) for r in records if r["scenario"] == "throughput")
    shared_end = max(r["t_end"] for r in records if r["scenario"] != "throughput")
    assert shared_end <= solo[0][0] and solo[0][1] <= solo[1][0]
