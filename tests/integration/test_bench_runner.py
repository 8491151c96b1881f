"""CPU tests of the benchmark runner (``benchmarks/run_all.py``): configurations, the worker and driver protocols,
provenance stamps, and one real quick run end to end.

The protocol tests use stand-in scripts that import nothing heavy; the end-to-end test runs S1's tiny model for
this package on the CPU (memory counters read 0 there, so it checks the harness, not the numbers).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import run_all  # noqa: E402 - importable once BENCH is on sys.path
import summary  # noqa: E402

FAKE_WORKER = textwrap.dedent('''
    """Stand-in worker: the runner's protocol (--spec, --result) without torch."""
    import argparse, json, os, sys
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec"); ap.add_argument("--result")
    a = ap.parse_args()
    spec = json.loads(a.spec)
    if spec.get("fail"):
        sys.exit(3)
    rec = {"scenario": "s3", **spec, "status": "ok", "peak_alloc_gib": 1.5, "step_time_s": 0.25,
           "tokens_per_step": 512, "params": 1 << 30, "device_name": "cpu",
           "threads": os.environ.get("OMP_NUM_THREADS"), "path": os.environ["PYTHONPATH"]}
    with open(a.result, "w") as f:
        json.dump(rec, f)
''')
FAKE_DRIVER = textwrap.dedent('''
    """Stand-in driver: --out, --impls and options in, a JSON-lines file out."""
    import json, pathlib, sys
    argv = sys.argv[1:]
    out = pathlib.Path(argv[argv.index("--out") + 1]); out.mkdir(parents=True)
    rec = {"scenario": "moe", "impl": argv[argv.index("--impls") + 1], "world_size": 1, "status": "ok",
           "median_step_s": 0.5, "tokens_per_s": 100.0, "device_name": "cpu", "argv": argv}
    (out / "moe.jsonl").write_text(json.dumps(rec) + "\\n")
''')


def _args(*argv: str) -> object:
    return run_all.parse_args(["--out", "/tmp/unused", *argv])


def test_specs_layer_defaults_set_and_variants() -> None:
    args = _args("--scenario", "s3", "--impl", "ours,fsdp2", "--set", '{"world_size": 8}')
    ours, fsdp2 = run_all.specs(args)
    assert ours == {**run_all.SCENARIOS["s3"].defaults, "world_size": 8, "impl": "ours"}
    assert fsdp2["stage"] is None and fsdp2["world_size"] == 8
    args = _args(
        "--scenario", "s3", "--impl", "ours", "--variant", 'blocksoff={"zero": {"x": false}}', "--variant", "a="
    )
    off, plain = run_all.specs(args)
    assert off["tag"] == "blocksoff" and off["zero"] == {"x": False} and plain["tag"] == "a"
    quick = run_all.specs(_args("--scenario", "s2", "--impl", "ours", "--quick"))[0]
    assert quick["model"] == "quick-s2"
    with pytest.raises(SystemExit, match="NAME="):
        run_all.parse_variant('{"zero": 1}')
    with pytest.raises(SystemExit, match="JSON object"):
        run_all.parse_variant("x=[1]")


def test_checkpoint_form_defaults() -> None:
    """Upstream's ZeRO-3 runs reentrant unless the spec says otherwise; the command leaves the default out."""
    from _harness import default_checkpoint_reentrant

    assert default_checkpoint_reentrant({"impl": "upstream", "stage": 3})
    assert not default_checkpoint_reentrant({"impl": "upstream", "stage": 2})
    assert not default_checkpoint_reentrant({"impl": "ours", "stage": 3})
    assert not default_checkpoint_reentrant({"impl": "upstream", "stage": 3, "checkpoint_reentrant": False})
    record = {"scenario": "s3", "impl": "upstream", "stage": 3, "model": "qwen2-3b", "checkpoint_reentrant": True}
    assert run_all.command_for(record) == "python benchmarks/run_all.py --scenario s3 --impl upstream --out OUT"
    flipped = run_all.command_for(dict(record, checkpoint_reentrant=False))
    assert json.loads(shlex.split(flipped)[-3]) == {"checkpoint_reentrant": False}


def _run(tmp_path: Path, *argv: str) -> tuple[int, list[dict]]:
    out = tmp_path / "out"
    with contextlib.redirect_stdout(io.StringIO()):
        rc = run_all.main(["--out", str(out), *argv])
    return rc, summary.read_records(out / "results.jsonl")


def test_workers_are_run_and_stamped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(FAKE_WORKER)
    monkeypatch.setitem(run_all.SCENARIOS, "s3", run_all.Scenario(str(worker), run_all.SCENARIOS["s3"].defaults))
    argv = ["--scenario", "s3", "--impl", "ours,upstream", "--upstream-target", "/up", "--extra-site", "/site"]
    rc, records = _run(tmp_path, *argv, "--variant", 'bad={"fail": true}', "--variant", "good=")
    assert rc == 1  # one run failed
    failed = [r for r in records if r["status"] == "error"]
    assert len(records) == 4 and len(failed) == 2 and all("wrote no result" in r["error"] for r in failed)
    ok = {r["impl"]: r for r in records if r["status"] == "ok"}
    assert ok["ours"]["path"].split(os.pathsep) == [str(REPO), "/site"]
    assert ok["upstream"]["path"].split(os.pathsep) == ["/up", "/site"]
    assert ok["ours"]["threads"] == str(os.cpu_count() or 1)
    for r in ok.values():
        assert r["measured_on"] == "cpu" and len(r["measured_at"]) == 10
        assert (
            r["command"]
            == f"python benchmarks/run_all.py --scenario s3 --impl {r['impl']} --variant 'good={{}}' --out OUT"
        )
    rows = json.loads((tmp_path / "out" / "summary.json").read_text())["rows"]
    assert [(r["scenario"], r["engine"]) for r in rows] == [
        ("s3_3b_zero3_512tok_good", e) for e in ("ours", "upstream")
    ]
    log = (tmp_path / "out" / "run_log.txt").read_text()
    assert log.count("$ ") == 4 and '"tag": "bad"' in log


def test_driver_scenarios_get_their_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver = tmp_path / "driver.py"
    driver.write_text(FAKE_DRIVER)
    monkeypatch.setitem(run_all.SCENARIOS, "moe", run_all.Scenario(str(driver), {}, {"smoke": True}, driver=True))
    rc, records = _run(tmp_path, "--scenario", "moe", "--impl", "ours", "--quick", "--set", '{"world_sizes": "1,8"}')
    assert rc == 0 and len(records) == 1
    argv = records[0]["argv"]
    assert "--smoke" in argv and argv[argv.index("--world-sizes") + 1] == "1,8"
    assert records[0]["command"].startswith("python benchmarks/run_all.py --scenario moe --impl ours --quick --set ")


def test_quick_s1_end_to_end(tmp_path: Path) -> None:
    """The real S1 worker on its tiny model, through the runner: an ok record whose command reproduces it."""
    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        rc, records = _run(tmp_path, "--scenario", "s1", "--impl", "ours", "--quick", "--set", '{"gas": 2}')
    assert rc == 0, records
    (record,) = records
    assert record["status"] == "ok" and record["gas"] == 2 and record["model"] == "quick"
    assert record["command"] == (
        "python benchmarks/run_all.py --scenario s1 --impl ours --quick --set '{\"gas\": 2}' --out OUT"
    )
    rows = json.loads((tmp_path / "out" / "summary.json").read_text())["rows"]
    assert [r["scenario"] for r in rows] == [summary.scenario_name(record)]
