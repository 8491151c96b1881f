"""The benchmark runner: one scenario, the engines to compare, and the configurations to measure.

    python benchmarks/run_all.py --scenario s3 --impl ours,upstream,fsdp2 --out DIR
    python benchmarks/run_all.py --scenario s3 --impl ours --set '{"world_size": 8}' --out DIR
    python benchmarks/run_all.py --scenario s3 --impl ours --variant blocksoff='{"zero": {...}}' --out DIR
    python benchmarks/run_all.py --scenario s1 --impl ours --quick --out DIR      # CPU smoke test, tiny models

Scenarios (``SCENARIOS``): ``s1`` gradient accumulation, ``s2`` initialisation, ``s3`` ZeRO-3 on a Qwen2-shaped
model, ``throughput`` tokens per second per ZeRO stage: one worker process per (engine, configuration), run one
after the other so that allocator counters and the GPU are never shared. ``moe``, ``pipeline``, ``memory_options``
and ``init`` have drivers of their own (several ranks, or several workers per configuration), which the runner
starts with the same engines; ``--set`` keys become their command-line options there.

Engines (``--impl``): ``ours`` (this package), ``ours_leanoff`` (its memory switches off), ``upstream`` (DeepSpeed
0.19.8 from ``--upstream-target``, ``baselines/upstream.py``), ``fsdp2`` (``baselines/fsdp2.py``) and, in S3,
``plain`` (one rank of plain PyTorch, ``baselines/plain.py``). ``--set JSON`` overrides the scenario's default
configuration for every run; each ``--variant NAME=JSON`` adds a run per engine with those overrides, named by
NAME (``tag``: the scenario row is suffixed with it). ``world_size`` above 1 runs rank 0 of a simulated job on
PyTorch's fake process group: exact per-rank allocations, no peers (collectives move no data).

Outputs in ``--out``: ``results.jsonl`` (one record per run, each stamped with ``measured_on``, ``measured_at`` and
the ``command`` that measures it again), ``summary.json`` (its rows, ``summary.py``) and ``run_log.txt``.
``python benchmarks/summary.py --add DIR/results.jsonl`` folds them into the committed record.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

import summary  # noqa: E402 - importable once BENCH is on sys.path


@dataclass(frozen=True)
class Scenario:
    """How a scenario runs: its script, default configuration, the overrides of a CPU smoke run, and whether the
    script is a driver of its own (``--out``, ``--impls``) instead of one ``--spec`` worker per run."""

    script: str
    defaults: dict = field(default_factory=dict)
    quick: dict = field(default_factory=dict)
    driver: bool = False
    upstream_flag: str = "--upstream-target"


SCENARIOS = {
    "s1": Scenario(
        "scenarios/s1_grad_accum.py",
        {"model": "gpt1.3b", "dtype": "bf16", "gas": 1, "world_size": 1, "stage": 2},
        {"model": "quick"},
    ),
    "s2": Scenario("scenarios/s2_init.py", {"model": "gpt2.6b", "dtype": "bf16", "world_size": 1, "stage": 1}, {}),
    "s3": Scenario(
        "scenarios/s3_zero3.py",
        {
            "model": "qwen2-3b",
            "dtype": "bf16",
            "gas": 1,
            "world_size": 1,
            "stage": 3,
            "warmup": 2,
            "offload": False,
            "offload_param": False,
        },
        {"model": "quick-qwen", "warmup": 1, "trace": False},
    ),
    "throughput": Scenario(
        "scenarios/throughput.py",
        {"model": "gpt1.3b", "dtype": "bf16", "gas": 1, "world_size": 1, "stage": 3, "warmup": 2, "steps": 5},
        {"model": "quick", "warmup": 1, "steps": 2},
    ),
    "moe": Scenario("scenarios/moe.py", {}, {"smoke": True}, driver=True),
    "pipeline": Scenario("scenarios/pipeline.py", {}, {"smoke": True}, driver=True),
    "memory_options": Scenario("scenarios/memory_options.py", {}, {"smoke": True}, driver=True),
    "init": Scenario("init_paths.py", {}, {"smoke": True}, True, "--upstream-path"),
}
QUICK_MODELS = {"s2": "quick-s2"}  # S2's tiny model differs from S1's
# Configuration keys a worker reads; a record's values of these that differ from the defaults are its command.
SPEC_KEYS = (
    "stage",
    "dtype",
    "gas",
    "world_size",
    "model",
    "micro_batch",
    "seq",
    "tile_mlp",
    "tile_loss",
    "offload",
    "offload_param",
    "warmup",
    "steps",
    "timed_steps",
    "checkpoint_reentrant",
    "checkpoint_early_stop",
    "trace",
    "zero",
)
NO_STAGE = ("fsdp2", "plain")  # engines without a ZeRO stage
FAMILY_SCENARIO = {"init_paths": "init"}  # summary family -> scenario name, where they differ


# ----------------------------------------------------------------------------------------------- configurations
def _defaults(name: str, quick: bool) -> dict:
    scenario = SCENARIOS[name]
    spec = dict(scenario.defaults)
    if quick:
        spec.update(scenario.quick)
        if name in QUICK_MODELS:
            spec["model"] = QUICK_MODELS[name]
    return spec


def parse_variant(text: str) -> tuple[str, dict]:
    """``NAME=JSON`` -> (NAME, overrides); a clear error naming the argument otherwise."""
    name, sep, body = text.partition("=")
    if not sep or not name or not name.replace("_", "").isalnum():
        raise SystemExit(f"--variant {text!r}: expected NAME='{{json overrides}}' with NAME letters, digits or _")
    overrides = json.loads(body) if body else {}
    if not isinstance(overrides, dict):
        raise SystemExit(f"--variant {text!r}: the overrides must be a JSON object")
    return name, overrides


def specs(args: argparse.Namespace) -> list[dict]:
    """One spec per (variant, engine): the defaults, ``--set``, the variant's overrides, the engine."""
    base = {**_defaults(args.scenario, args.quick), **json.loads(args.set or "{}")}
    variants: list[tuple[str, dict]] = [parse_variant(v) for v in args.variant] or [("", {})]
    out = []
    for tag, overrides in variants:
        for impl in args.impl.split(","):
            spec = {**base, **overrides, "impl": impl}
            if tag:
                spec["tag"] = tag
            if impl in NO_STAGE:
                spec["stage"] = None
            out.append(spec)
    return out


def _set_of(record: dict, name: str, quick: bool) -> dict:
    """The overrides that reproduce a worker record's configuration from the scenario's defaults."""
    defaults = _defaults(name, quick)
    found = {k: record[k] for k in SPEC_KEYS if k in record and record[k] != defaults.get(k)}
    if not isinstance(found.get("trace", False), bool):
        del found["trace"]  # the record's trace summary, not the switch that turns tracing off
    if record.get("impl") in NO_STAGE:
        found.pop("stage", None)
    if "checkpoint_reentrant" in found and found["checkpoint_reentrant"] == summary._default_reentrant(record):
        del found["checkpoint_reentrant"]  # the worker's own default for this engine and stage
    return {k: v for k, v in found.items() if v is not None}


def _driver_set(record: dict, name: str) -> dict:
    """The driver options that measure a driver record's configuration again."""
    if name == "init":
        return {"configs": record.get("config"), "model": record.get("model")}
    if name == "pipeline":
        return {"gas": str(record.get("gas")), "dtype": record.get("dtype")}
    if name == "moe":
        return {"world_sizes": str(record.get("world_size")), "dtype": record.get("dtype")}
    return {"only": record.get("group")}


def command_for(record: dict, quick: bool = False) -> str:
    """The runner command line that measures ``record``'s configuration and engine again."""
    kind = summary.family(record)
    name = FAMILY_SCENARIO.get(str(kind), str(kind))
    options = _driver_set(record, name) if SCENARIOS[name].driver else _set_of(record, name, quick)
    parts = ["python benchmarks/run_all.py --scenario", name, "--impl", str(record.get("impl"))]
    parts += ["--quick"] if quick else []
    if record.get("tag"):
        parts += ["--variant", shlex.quote(f"{record['tag']}={json.dumps(options)}")]
    elif options:
        parts += ["--set", shlex.quote(json.dumps(options))]
    return " ".join([*parts, "--out OUT"])


# ----------------------------------------------------------------------------------------------- running
def _env(impl: str, args: argparse.Namespace, port: int) -> dict:
    """A worker's environment: which ``deepspeed`` it imports, a rendezvous of its own, every core."""
    env = dict(os.environ)
    root = args.upstream_target if impl == "upstream" else str(REPO)
    env["PYTHONPATH"] = os.pathsep.join([root] + ([args.extra_site] if args.extra_site else []))
    env.update(
        PYTHONUNBUFFERED="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        OMP_NUM_THREADS=str(os.cpu_count() or 1),
        DS_BUILD_OPS="0",
    )
    return env


def _launch(cmd: list[str], env: dict, log, timeout: float) -> str | None:
    """Run one process with its output appended to ``log``; the reason when it did not finish in time."""
    log.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
    log.flush()
    try:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd="/tmp", env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"killed after --job-timeout-s {timeout:.0f} s"
    return None


def run_worker(spec: dict, args: argparse.Namespace, index: int, log) -> dict:
    """One worker process: its record, or an error record saying why there is none."""
    result = Path(tempfile.mkdtemp(prefix="bench_")) / "result.json"
    script = str(BENCH / SCENARIOS[args.scenario].script)
    cmd = [sys.executable, script, "--spec", json.dumps(spec), "--result", str(result)]
    killed = _launch(cmd, _env(spec["impl"], args, 20000 + (os.getpid() % 400) * 100 + index), log, args.job_timeout_s)
    if killed is None and result.exists():
        return {**json.loads(result.read_text()), "scenario": args.scenario}  # the worker names its script
    why = killed or "the worker wrote no result (run_log.txt has its output)"
    return {"scenario": args.scenario, **spec, "status": "error", "error": why}


def run_driver(args: argparse.Namespace, out: Path, log) -> list[dict]:
    """A scenario with a driver of its own: its options from ``--set``, its records from the files it writes."""
    scenario = SCENARIOS[args.scenario]
    where = out / f"{args.scenario}_driver"
    cmd = [sys.executable, str(BENCH / scenario.script), "--out", str(where), "--impls", args.impl]
    cmd += [scenario.upstream_flag, args.upstream_target] + (
        ["--extra-site", args.extra_site] if args.extra_site else []
    )
    options = {**_defaults(args.scenario, args.quick), **json.loads(args.set or "{}")}
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        cmd += [flag] if value is True else [] if value is False else [flag, str(value)]
    killed = _launch(cmd, _env("ours", args, 20000 + (os.getpid() % 400) * 100), log, args.job_timeout_s)
    records = [r for p in sorted(where.glob("*.jsonl")) for r in summary.read_records(p)]
    if killed:
        records.append({"scenario": args.scenario, "impl": args.impl, "status": "error", "error": killed})
    return records


def stamp(record: dict, today: str, quick: bool) -> dict:
    """Provenance of a fresh record: the card it ran on, the date, the command that measures it again."""
    record.setdefault("measured_on", record.get("device_name", "unknown"))
    record.setdefault("measured_at", today)
    if summary.family(record) is not None:
        record.setdefault("command", command_for(record, quick))
    return record


def _line(record: dict) -> str:
    figures = summary.figures(record) if summary.family(record) else {}
    shown = {k: round(v, 3) for k, v in figures.items() if isinstance(v, float)}
    what = summary.scenario_name(record) if summary.family(record) else record.get("scenario")
    return f"{what} {record.get('impl')}: {record.get('status')} {shown} {str(record.get('error', ''))[:200]}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    ap.add_argument("--impl", default="ours,upstream,fsdp2", help="comma list of engines")
    ap.add_argument("--set", default="", help="JSON object of configuration overrides for every run")
    ap.add_argument("--variant", action="append", default=[], help="NAME='{json overrides}', repeatable")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="tiny models (CPU smoke test of the harness)")
    ap.add_argument("--upstream-target", default="/tmp/upstream_ds", help="where upstream DeepSpeed is installed")
    ap.add_argument("--extra-site", default=os.environ.get("BENCH_EXTRA_SITE", ""), help="extra site directory")
    ap.add_argument("--job-timeout-s", type=float, default=600.0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    with open(args.out / "run_log.txt", "w") as log:
        if SCENARIOS[args.scenario].driver:
            records = run_driver(args, args.out, log)
        else:
            records = [run_worker(spec, args, i, log) for i, spec in enumerate(specs(args))]
    records = [stamp(r, today, args.quick) for r in records]
    (args.out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (args.out / "summary.json").write_text(summary.dumps(summary.rows(r for r in records if r.get("status") == "ok")))
    for record in records:
        print(_line(record), flush=True)
    return 0 if all(r.get("status") in ("ok", "skipped") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
