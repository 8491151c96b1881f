"""The current record of the benchmarks: raw JSON-lines records -> ``results/summary.json``.

    python benchmarks/summary.py                          # regenerate results/summary.json from results/*.jsonl
    python benchmarks/summary.py --add OUT/results.jsonl  # fold a new run into the record, then regenerate

``results/`` holds one raw file per scenario family (``s1.jsonl``, ``s3.jsonl``, ...) with the latest record of
every configuration and engine; each record carries its provenance: ``measured_on`` (the card), ``measured_at``
(the date) and ``command`` (the ``run_all.py`` command line that measures it again). ``--add`` replaces, per
scenario row and engine, the stored record by the new one; older measurements live in the git history only.

``summary.json`` is ``{"methods": {family: what is measured}, "rows": [...]}``; a row is ``ROW_KEYS``: the scenario
name (``scenario_name``: a function of the configuration only, so the engines measured on one configuration share
it), the engine (``ours``, ``fsdp2``, ``upstream`` or ``plain``; this package's runs with its memory switches off
are named ``..._leanoff``), the figures (null where the record does not measure one), the model-state floor of the
configuration (``floors.py``), and the provenance of the record.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable
from pathlib import Path

from floors import floor_gib

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
SUMMARY = RESULTS / "summary.json"
FIGURES = ("step_s", "peak_alloc_gib", "peak_reserved_gib", "reserved_after_init_gib", "alloc_after_init_gib")
ROW_KEYS = (
    "scenario",
    "family",
    "engine",
    *FIGURES,
    "tokens_per_s",
    "floor_gib",
    "measured_on",
    "measured_at",
    "command",
)
ENGINES = ("ours", "fsdp2", "upstream", "plain")
# Implementation names of the records -> engine. ``before`` (init_paths.py: an older copy of this package, kept to
# show what a change replaced) is history, not an engine to compare, and gets no row.
_ENGINE_OF = {"ours": "ours", "ours_leanoff": "ours", "fsdp2": "fsdp2", "upstream": "upstream", "plain": "plain"}
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
# What each family measures (summary.json's ``methods``; docs/benchmarks.md prints them).
METHODS = {
    "s1": "GPT-shaped 1.3B decoder built on the device; after a warm-up step, one measured optimizer step of GAS "
    "micro-batches of 2048 tokens (forward and backward each); peak = allocator peak over that step; step = its "
    "wall time.",
    "s2": "GPT-shaped 2.6B decoder built on the device in bf16 (FSDP2: fp32); peak = allocator peak during "
    "deepspeed.initialize (FSDP2: fully_shard and the optimizer's creation); no step is timed.",
    "s3": "Qwen2-shaped decoder (3.09B or 7.62B), activation checkpointing in every layer, the ZeRO config HF "
    "Trainer's 'auto' resolves to; warm-up steps (two, one when offloaded), then a measured step (its peak is the "
    "figure) and more timed steps (step = median).",
    "throughput": "GPT-shaped 1.3B decoder, 2048 tokens per step, 2 warm-up and 5 timed steps; step = median, "
    "peak over the timed steps.",
    "init_paths": "Qwen2-shaped 3.09B decoder built outside deepspeed.initialize (on the host or the device); "
    "peak = allocator peak during initialize.",
    "memory_options": "Memory options of ZeRO (16-bit optimizer states, torch.compile); median step and peak "
    "over the timed steps.",
    "moe": "Mixture-of-experts decoder (8 layers, hidden 1024, 8 experts, top-2 routing), ZeRO-2 with expert "
    "parallelism; median step and peak over the timed steps.",
    "pipeline": "Pipeline-parallel GPT-shaped decoder (24 layers, hidden 2048) on two stages, ZeRO-1; per stage: "
    "peak and step over the timed steps.",
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
    "host_offload_s3": {"stage": 3, "dtype": "bf16", "offload": True, "build": "host"},
    "host_offload_s3_fp32": {"stage": 3, "dtype": "fp32", "offload": True, "build": "host"},
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
    if r.get("tag"):  # a named variant of the runner (``--variant NAME=...``)
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
        stage = 3 if r.get("impl") in ("fsdp2", "plain") else r.get("stage", _DEFAULT_STAGE.get(kind))
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


def family(r: dict) -> str | None:
    """The scenario family of a record (its raw file's name), or None when it is not an engine measurement."""
    return _kind(r)


def _num(x: object) -> float | None:
    return round(float(x), 6) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def every_step_skipped(r: dict) -> bool:
    """A run whose every step was skipped (on the simulated group the collectives' outputs are uninitialised and
    can trip an overflow check) never built optimizer state: its memory figures are not comparable."""
    return bool(r.get("skipped_steps")) and r["skipped_steps"] >= int(r.get("warmup_steps") or 0) + 1


def figures(record: dict) -> dict:
    """The summary's figures of one record (null where not measured; every figure null unless ``status`` is ok).

    Step: S1/S3 ``step_time_s`` (S3: median of its timed steps), throughput / MoE / memory options
    ``median_step_s``, pipeline ``step_s``; S2 and init_paths time no step. Peaks: the scenario's measured window
    (one optimizer step; S2 and init_paths: ``initialize``). tokens/s: the record's, else tokens per step / step.
    """
    out: dict = {k: None for k in (*FIGURES, "tokens_per_s", "floor_gib")}
    r, kind = _config(record), _kind(record)
    if r.get("status") != "ok" or every_step_skipped(r):
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
        out["floor_gib"] = _num(floor_gib(r)) if kind in ("s1", "s3", "throughput") else None
    out["reserved_after_init_gib"] = _num(r.get("reserved_after_init_gib"))
    out["alloc_after_init_gib"] = _num(r.get("alloc_after_init_gib"))
    tps = _num(r.get("tokens_per_s"))
    if tps is None and out["step_s"] and r.get("tokens_per_step"):
        tps = _num(r["tokens_per_step"] / out["step_s"])
    out["tokens_per_s"] = tps
    return out


def row_of(record: dict) -> dict:
    """The summary row of one named record."""
    provenance = {k: record.get(k) for k in ("measured_on", "measured_at", "command")}
    name, kind = scenario_name(record), _kind(record)
    return {"scenario": name, "family": kind, "engine": _ENGINE_OF[record["impl"]], **figures(record), **provenance}


def _natural(name: str) -> list:
    """Sort key that puts ``gas4`` before ``gas16`` (digit runs compare as numbers)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _key(row: dict) -> tuple:
    return (_natural(row["scenario"]), ENGINES.index(row["engine"]))


def latest(records: Iterable[dict]) -> dict[tuple[str, str], dict]:
    """Per (scenario name, engine): the record measured last (a later one of equal date wins, so a file's order
    decides among records of one day)."""
    out: dict[tuple[str, str], dict] = {}
    for rec in records:
        name = scenario_name(rec)
        if name is None:
            continue
        key = (name, _ENGINE_OF[rec["impl"]])
        if key not in out or str(rec.get("measured_at", "")) >= str(out[key].get("measured_at", "")):
            out[key] = rec
    return out


def read_records(path: Path) -> list[dict]:
    """The JSON lines of one results file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def stored(results: Path = RESULTS) -> list[dict]:
    """Every record of the committed raw files, in file-name order."""
    return [r for p in sorted(Path(results).glob("*.jsonl")) for r in read_records(p)]


def rows(records: Iterable[dict]) -> list[dict]:
    """The summary rows of ``records`` (latest per row), sorted by scenario name then engine."""
    return sorted((row_of(r) for r in latest(records).values()), key=_key)


def dumps(summary_rows: list[dict]) -> str:
    """summary.json's text: the methods, then one row per line (diffs stay readable)."""
    used = sorted({r["family"] for r in summary_rows})
    methods = ",\n".join(f"  {json.dumps(k)}: {json.dumps(METHODS[k])}" for k in used)
    body = ",\n".join("  " + json.dumps({k: row[k] for k in ROW_KEYS}) for row in summary_rows)
    return '{\n"methods": {\n' + methods + '\n},\n"rows": [\n' + body + "\n]\n}\n"


def add(records: list[dict], results: Path = RESULTS) -> int:
    """Fold new records into the raw files: each named record replaces the stored one of its row and engine.
    Returns how many records were stored."""
    new = latest(r for r in records if r.get("status") == "ok" and not every_step_skipped(r))
    by_family: dict[str, list[dict]] = {}
    for rec in stored(results):
        by_family.setdefault(str(_kind(rec)), []).append(rec)
    for key, rec in new.items():
        kind = str(_kind(rec))
        kept = [r for r in by_family.get(kind, []) if (scenario_name(r), _ENGINE_OF.get(r.get("impl", ""))) != key]
        by_family[kind] = [*kept, rec]
    for kind, recs in by_family.items():
        (Path(results) / f"{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return len(new)


def write(results: Path = RESULTS) -> Path:
    """Regenerate ``summary.json`` from the raw files in ``results``."""
    out = Path(results) / "summary.json"
    out.write_text(dumps(rows(stored(results))))
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--add", nargs="*", type=Path, default=[], help="results.jsonl files of new runs to fold in")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the folder of the record")
    a = ap.parse_args(argv)
    if a.add:
        count = add([r for p in a.add for r in read_records(p)], a.results)
        print(f"{count} records folded into {a.results}")
    out = write(a.results)
    print(f"{out}: {len(json.loads(out.read_text())['rows'])} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
