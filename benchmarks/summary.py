"""One machine-readable summary of benchmark runs: raw JSON-lines records -> ``summary.json`` rows.

    python benchmarks/summary.py benchmarks/results --out benchmarks/results/summary.json   # every committed run
    python benchmarks/summary.py DIR/results.jsonl --run-name NAME --out DIR/summary.json     # one run

Each row is ``{"scenario", "engine", "run", "step_s", "peak_alloc_gib", "peak_reserved_gib",
"reserved_after_init_gib", "alloc_after_init_gib", "tokens_per_s"}`` (``ROW_KEYS``), figures null where the record
did not measure them (or the configuration did not run). ``engine`` is ``ours`` (lean-off rows too: their scenario
name ends in ``_leanoff``), ``fsdp2`` or ``upstream``; ``run`` is the results file it came from, relative to the
results folder and without ``.jsonl`` (``gpu_run15``, ``s3_solo/gpu_run16_s3_solo``). The scenario name is a
function of the record's configuration only (``scenario_name``; the table of parts is in benchmarks/README.md),
so the engines measured on one configuration share it and a row can be matched across runs.

Within one file a later record of the same configuration replaces an earlier one (a re-run layered over a run,
as ``report.py`` does); two different configurations that would get the same name are an error, never merged.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
ROW_KEYS = (
    "scenario",
    "engine",
    "run",
    "step_s",
    "peak_alloc_gib",
    "peak_reserved_gib",
    "reserved_after_init_gib",
    "alloc_after_init_gib",
    "tokens_per_s",
)
ENGINES = ("ours", "fsdp2", "upstream")
# Implementation names of the records -> engine. ``before`` (init_paths.py: an older copy of this package, kept to
# show what a change replaced) is history, not an engine to compare, and gets no row.
_ENGINE_OF = {"ours": "ours", "ours_leanoff": "ours", "fsdp2": "fsdp2", "upstream": "upstream"}
# Record ``scenario`` (or, for init_paths.py, the presence of ``config``) -> name prefix.
PREFIX = {
    "s1": "s1",
    "s2": "s2",
    "s3": "s3",
    "throughput": "tp",
    "pipeline": "pipe",
    "moe": "moe",
    "memory_options": "memopt",
    "init_paths": "init",
}
# ZeRO stage of scenarios whose records do not carry one (moe.py runs ZeRO-2, the pipeline ZeRO-1).
_DEFAULT_STAGE = {"moe": 2, "pipeline": 1}
# Model sequence lengths of records that carry neither ``tokens_per_step`` nor ``model_cfg`` (a configuration that
# never ran records its spec only); the same values as ``models.py``, which needs torch to import.
_SEQ = {
    "gpt1.3b": 2048,
    "gpt2.6b": 2048,
    "qwen2-3b": 512,
    "qwen2.5-7b": 512,
    "quick": 32,
    "quick-s2": 32,
    "quick-qwen": 32,
}
# moe.py's model shapes (FULL / SMOKE there), for its records that failed before recording ``model_cfg``.
_MOE_SHAPES = {
    False: {"layers": 8, "hidden": 1024, "seq": 1024, "micro_batch": 4, "experts": 8},
    True: {"layers": 2, "hidden": 32, "seq": 16, "micro_batch": 2, "experts": 8},
}
# init_paths.py's configurations: ZeRO stage, training dtype, offload and where the model was built.
_INIT_CONFIGS = {
    "report3_bf16": {"stage": 3, "dtype": "bf16", "offload": True, "build": "host"},
    "report3_fp32": {"stage": 3, "dtype": "fp32", "offload": True, "build": "host"},
    "host_s1": {"stage": 1, "dtype": "bf16", "build": "host"},
    "host_s2": {"stage": 2, "dtype": "bf16", "build": "host"},
    "host_s3": {"stage": 3, "dtype": "bf16", "build": "host"},
    "device_s3": {"stage": 3, "dtype": "bf16", "build": "device"},
    "init_remote_s3": {"stage": 3, "dtype": "bf16", "build": "zeroinit", "offload_param": True},
}


def _kind(r: dict) -> str | None:
    """The scenario family of a record, or None for records that are not engine measurements (parity checks,
    kernel timings, client stacks, the per-group ratio records of memory_options)."""
    if "summary" in r:
        return None
    if r.get("scenario") in PREFIX:
        return str(r["scenario"])
    if "config" in r and r.get("config") in _INIT_CONFIGS:
        return "init_paths"
    return None


def _config(r: dict) -> dict:
    """The record with init_paths' named configuration expanded into the fields the other scenarios carry."""
    kind = _kind(r)
    if kind == "init_paths":
        return {**r, **_INIT_CONFIGS[r["config"]], "world_size": 1}
    if kind == "moe" and not isinstance(r.get("model_cfg"), dict):
        return {**r, "model_cfg": _MOE_SHAPES[bool(r.get("smoke"))]}
    return r


def model_part(model: object) -> str:
    """``qwen2-3b`` -> ``3b``, ``gpt1.3b`` -> ``1.3b`` (the size the benchmark model is named after); a model given
    as a shape (pipeline, MoE) -> ``l{layers}h{hidden}`` plus ``e{experts}``; otherwise the name itself."""
    if isinstance(model, dict):
        experts = f"e{model['experts']}" if model.get("experts") else ""
        return f"l{model.get('layers')}h{model.get('hidden')}{experts}"
    m = re.search(r"(\d+(?:\.\d+)?b)$", str(model))
    return m.group(1) if m else str(model)


def tokens_per_micro_step(r: dict) -> int | None:
    """Tokens of one micro-batch: the record's ``tokens_per_step`` / GAS, else micro-batch x sequence length."""
    gas = int(r.get("gas") or 1)
    if r.get("tokens_per_step") and _kind(r) != "pipeline":
        return int(r["tokens_per_step"]) // gas
    shape = r.get("model_cfg") if isinstance(r.get("model_cfg"), dict) else r.get("model")
    shape = shape if isinstance(shape, dict) else {}
    seq = r.get("seq") or shape.get("seq") or _SEQ.get(str(r.get("model")))
    micro = r.get("micro_batch") or shape.get("micro_batch") or 1
    return int(seq) * int(micro) if seq else None


def _default_reentrant(r: dict) -> bool:
    """The checkpoint form a spec gets when it does not set one (``_harness.default_checkpoint_reentrant``)."""
    return r.get("impl") == "upstream" and r.get("stage", 3) == 3


def _variant(r: dict, kind: str) -> list[str]:
    """Name parts of the switches some scenarios vary beyond the common ones."""
    parts = []
    if kind == "memory_options" and r.get("group") == "bf16":
        parts.append("bf16states" if r.get("bf16_states") else "fp32states")
    if kind == "memory_options" and r.get("group") == "compile":
        parts.append("compiled" if r.get("compiled") else "eager")
    if kind == "init_paths":
        parts.append(f"built{r.get('build')}")
    if kind == "s3" and r.get("tag"):  # an A/B variant of single switches (spec "zero" + "tag")
        parts.append(str(r["tag"]))
    if kind in ("s3", "throughput") and bool(
        r.get("checkpoint_reentrant", _default_reentrant(r))
    ) != _default_reentrant(r):
        parts.append("reentrant" if r["checkpoint_reentrant"] else "nonreentrant")
    return parts


def scenario_name(record: dict) -> str | None:
    """The scenario name of a raw record (the table in benchmarks/README.md), or None when it gets no row.

    ``{prefix}_{model}_{parallel}[_{dtype}]_{tokens}tok[_gas{G}][_n{N}][_offload|_offload_param][_{variant}]
    [_leanoff]``: parallel is ``zero{stage}`` (FSDP2, everything sharded: ``zero3``; the pipeline
    ``pp{stages}_stage{k}``), dtype only when not bf16, tokens per micro-batch, GAS and N only when above 1.
    """
    kind = _kind(record)
    if kind is None or record.get("impl") not in _ENGINE_OF:
        return None
    if kind == "memory_options" and record.get("group") == "offload":
        return None  # offload_states(): times and held bytes, none of the summary's figures
    r = _config(record)
    model = r.get("model_cfg") if kind == "moe" else r.get("model")
    if kind == "pipeline":
        shape = r.get("model") if isinstance(r.get("model"), dict) else {}
        parallel = f"pp{shape.get('stages', 2)}_stage{r.get('stage')}"
    else:
        stage = 3 if r.get("impl") == "fsdp2" else r.get("stage", _DEFAULT_STAGE.get(kind))
        parallel = f"zero{stage}"
    parts = [PREFIX[kind], model_part(model), parallel]
    if r.get("dtype") and r.get("dtype") != "bf16":
        parts.append(str(r["dtype"]))
    tokens = tokens_per_micro_step(r)
    parts.append(f"{tokens}tok" if tokens else "tok")
    if int(r.get("gas") or 1) > 1:
        parts.append(f"gas{int(r['gas'])}")
    if int(r.get("world_size") or 1) > 1:
        parts.append(f"n{int(r['world_size'])}")
    if r.get("offload_param"):
        parts.append("offload_param")
    elif r.get("offload"):
        parts.append("offload")
    parts += _variant(r, kind)
    if r.get("impl") == "ours_leanoff":
        parts.append("leanoff")
    return "_".join(parts)


def _num(x: object) -> float | None:
    return round(float(x), 6) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def figures(record: dict) -> dict:
    """The summary's figures of one record (null where not measured; every figure null unless ``status`` is ok).

    Step: S1/S3 ``step_time_s`` (S3: median of its timed steps), throughput / MoE / memory options
    ``median_step_s``, pipeline ``step_s``; S2 and init_paths time no step. Peaks: the scenario's measured window
    (one optimizer step; S2 and init_paths: ``initialize``). tokens/s: the record's, else tokens per step / step.
    """
    out = {k: None for k in ROW_KEYS[3:]}
    r, kind = _config(record), _kind(record)
    if r.get("status") != "ok":
        return out
    mem = r.get("memory_gib") if isinstance(r.get("memory_gib"), dict) else {}
    step = next((r[k] for k in ("step_time_s", "median_step_s", "step_s") if _num(r.get(k)) is not None), None)
    out["step_s"] = _num(step)
    if kind in ("s2", "init_paths"):
        out["peak_alloc_gib"] = _num(r.get("init_peak_alloc_gib"))
        out["peak_reserved_gib"] = _num(r.get("init_peak_reserved_gib"))
    else:
        out["peak_alloc_gib"] = _num(r.get("peak_alloc_gib", mem.get("peak_alloc")))
        out["peak_reserved_gib"] = _num(r.get("peak_reserved_gib", mem.get("peak_reserved")))
    out["reserved_after_init_gib"] = _num(r.get("reserved_after_init_gib"))
    out["alloc_after_init_gib"] = _num(r.get("alloc_after_init_gib"))
    tps = _num(r.get("tokens_per_s"))
    if tps is None and out["step_s"] and r.get("tokens_per_step"):
        tps = _num(r["tokens_per_step"] / out["step_s"])
    out["tokens_per_s"] = tps
    return out


def _identity(r: dict) -> str:
    """Everything about a record's configuration that ``scenario_name`` may read, normalised as it reads it (same
    identity: a re-run of one configuration, which replaces the earlier record)."""
    c = _config(r)
    keys = (
        "scenario",
        "config",
        "impl",
        "stage",
        "dtype",
        "gas",
        "world_size",
        "micro_batch",
        "seq",
        "group",
        "bf16_states",
        "compiled",
        "build",
        "tag",
    )
    ident: dict = {k: c.get(k) for k in keys}
    ident["model"] = model_part(c.get("model_cfg") if _kind(c) == "moe" else c.get("model"))
    ident["offload"], ident["offload_param"] = bool(c.get("offload")), bool(c.get("offload_param"))
    ident["reentrant"] = bool(c.get("checkpoint_reentrant", _default_reentrant(c)))
    ident["tokens"] = tokens_per_micro_step(c)
    return json.dumps(ident, sort_keys=True, default=str)


def rows_of(records: Iterable[dict], run: str) -> list[dict]:
    """Summary rows of one run's records, sorted by scenario name (numbers by value) then engine (ours, fsdp2,
    upstream)."""
    by_identity: dict[str, tuple[str, dict]] = {}
    for rec in records:
        name = scenario_name(rec)
        if name is not None:
            by_identity[_identity(rec)] = (name, rec)  # later records of one configuration replace earlier ones
    rows: dict[tuple[str, str], dict] = {}
    for ident, (name, rec) in by_identity.items():
        engine = _ENGINE_OF[rec["impl"]]
        if (name, engine) in rows:
            raise ValueError(
                f"{run}: two configurations are both named {name!r} ({engine}); the naming in "
                f"summary.scenario_name must tell them apart: {ident}"
            )
        rows[(name, engine)] = {"scenario": name, "engine": engine, "run": run, **figures(rec)}
    return [rows[k] for k in sorted(rows, key=lambda k: (_natural(k[0]), ENGINES.index(k[1])))]


def _natural(name: str) -> list:
    """Sort key that puts ``gas4`` before ``gas16`` (digit runs compare as numbers)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def run_name(path: Path, root: Path = RESULTS) -> str:
    """``benchmarks/results/s3_solo/gpu_run16_s3_solo.jsonl`` -> ``s3_solo/gpu_run16_s3_solo``; a file outside
    ``root``: its stem."""
    path = Path(path).resolve()
    try:
        return path.relative_to(Path(root).resolve()).with_suffix("").as_posix()
    except ValueError:
        return path.stem


def read_records(path: Path) -> list[dict]:
    """The JSON lines of one results file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def expand(paths: Iterable[Path]) -> list[Path]:
    """Files as given; a folder stands for every ``*.jsonl`` under it, sorted by path."""
    out: list[Path] = []
    for p in map(Path, paths):
        out += sorted(p.rglob("*.jsonl"), key=lambda f: f.relative_to(p).as_posix()) if p.is_dir() else [p]
    return out


def summarize(paths: Iterable[Path], root: Path = RESULTS, runs: Iterable[str] | None = None) -> list[dict]:
    """Rows of every file (a folder: its ``*.jsonl`` files), in the order given; ``runs`` names them (default:
    ``run_name``)."""
    paths = expand(paths)
    names = list(runs) if runs is not None else [run_name(p, root) for p in paths]
    if len(set(names)) != len(names):
        raise ValueError(f"two results files have the same run name: {names}")
    return [row for p, name in zip(paths, names, strict=True) for row in rows_of(read_records(p), name)]


def dumps(rows: list[dict]) -> str:
    """summary.json's text: a JSON list, one row per line (diffs stay readable)."""
    return "[\n" + ",\n".join(json.dumps({k: row[k] for k in ROW_KEYS}) for row in rows) + "\n]\n"


def write(rows: list[dict], out: Path) -> None:
    """Write ``rows`` to ``out`` as ``dumps`` formats them."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(dumps(rows))


def write_run(records: list[dict], out: Path, run: str) -> Path | None:
    """``run_all.py``'s hook: the rows of one run's records to ``out``; None (and a line on stdout) when two of its
    configurations clash (the records are on disk already: a naming problem must not cost the run's report)."""
    try:
        write(rows_of(records, run), out)
    except ValueError as exc:
        print(f"{out.name} not written: {exc}", flush=True)
        return None
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", nargs="+", type=Path, help="results files, or folders (every *.jsonl under them)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--root", type=Path, default=RESULTS, help="run names are file paths relative to this folder")
    ap.add_argument("--run-name", default="", help="name of the run (one input file only; default: from its path)")
    a = ap.parse_args(argv)
    files = expand(a.jsonl)
    if a.run_name and len(files) != 1:
        ap.error("--run-name takes exactly one input file")
    rows = summarize(files, a.root, [a.run_name] if a.run_name else None)
    write(rows, a.out)
    print(f"{a.out}: {len(rows)} rows from {len(files)} file(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
