"""Generate ``docs/benchmarks.md`` from the current record, ``benchmarks/results/summary.json``.

    python benchmarks/report.py                  # writes docs/benchmarks.md
    python benchmarks/report.py --check          # exits 1 when docs/benchmarks.md is not what it would write

The page holds the current figure of every scenario row (``summary.py``) with what is measured, on which card,
against which baselines, the ratios and the model-state floor (``floors.py``), and the command that measures each
row again. A short block between ``<!-- figures:begin -->`` and ``<!-- figures:end -->`` carries the headline
figures for other pages to include.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import floors  # noqa: E402 - importable once BENCH is on sys.path
import summary  # noqa: E402

DOCS = BENCH.parent / "docs" / "benchmarks.md"
ENGINE_LABEL = {"ours": "ours", "fsdp2": "FSDP2", "upstream": "upstream", "plain": "plain PyTorch"}
TITLES = {
    "s1": "Gradient accumulation",
    "s2": "Initialisation",
    "s3": "ZeRO-3 on a Qwen2-shaped model",
    "throughput": "Throughput per ZeRO stage",
    "init_paths": "Placing a model built outside the engine",
    "memory_options": "Memory options",
    "moe": "Mixture of experts",
    "pipeline": "Pipeline parallelism",
}
ORDER = ("s3", "s1", "s2", "throughput", "init_paths", "memory_options", "moe", "pipeline")
# The headline rows of the figures block: (scenario row, what it shows).
HEADLINES = (
    ("s3_3b_zero3_8192tok", "ZeRO-3, 3.09B model, one GPU, 8192 tokens per step"),
    ("s3_3b_zero3_512tok_n8", "ZeRO-3, 3.09B model, per rank at a simulated world size of 8"),
    ("s3_3b_zero3_512tok_offload", "ZeRO-3, 3.09B model, optimizer offloaded to the host, one GPU"),
    ("s1_1.3b_zero2_2048tok_gas16", "ZeRO-2, 1.3B model, 16 accumulated micro-batches, one GPU"),
)
TERMS = """\
- **Peak allocated / reserved**: the largest device memory held by tensors (PyTorch's caching allocator,
  `max_memory_allocated`) and held by the allocator (`max_memory_reserved`) over the measured window, in GiB
  (2^30 bytes). Allocated is what the engine needs; reserved adds the allocator's cache.
- **Model-state floor**: the bytes per parameter of the states ZeRO must keep on one rank (16-bit parameter and
  gradient, fp32 optimizer state, each partitioned as the mode says), times the parameter count: the reference
  against which `ours ÷ floor` shows what an engine adds (activations, gathered layers, buffers). It is the
  classic layout, not a hard bound: where this package keeps less (with `lean_gather_from_master` the fp32 master
  serves as the parameter shard, with no 16-bit copy beside it), a peak can read below it. The formulas per mode:

{floors}
  (`benchmarks/floors.py` holds them.)
- **Simulated world size** (`n8`, `n16`, `n64` in a row's name): rank 0 of an N-rank job run on PyTorch's fake
  process group, which gives the exact per-rank allocation of a real rank with no peers; collectives move no
  data, so step times there are not those of a real job.
- **Engines**: *ours* is this package (its memory switches on, the defaults); *upstream* is DeepSpeed 0.19.8 run
  on the same model, config and batch; *FSDP2* is PyTorch's `fully_shard`, one unit per decoder layer and one at
  the root; *plain PyTorch* is the bare model under torch's AdamW on one GPU (the speed floor, with bf16 optimizer
  state). A row ending in `_leanoff` is this package with its memory switches off.
- **Ratios**: `ours ÷ upstream` and `ours ÷ FSDP2` divide this package's peak allocated memory by the baseline's
  on the same row (below 1: less memory); `ours ÷ floor` divides it by the model-state floor.
- **Row names**: `{{scenario}}_{{model}}_zero{{stage}}[_{{dtype}}]_{{tokens}}tok[_gas{{G}}][_n{{N}}][_offload|
  _offload_param][_{{variant}}][_leanoff]`: the model's size, the ZeRO stage (FSDP2 and plain PyTorch are listed
  under `zero3`), the training dtype when not bf16, tokens per micro-batch, gradient-accumulation steps and
  simulated world size when above 1, what is offloaded to the host, and a named variant (`blocksoff`:
  `lean_block_fetch_units` off, `masteroff`: `lean_gather_from_master` off, `unitoff`: `lean_unit_grad_reduce`
  off)."""


def _floor_table() -> str:
    doc = floors.__doc__ or ""
    return "\n".join("  " + line for line in doc.splitlines() if line.startswith("|"))


def _g(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if not a or not b else f"{a / b:.2f}"


def by_scenario(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """scenario name -> engine -> row, in the summary's order."""
    out: dict[str, dict[str, dict]] = defaultdict(dict)
    for row in rows:
        out[row["scenario"]][row["engine"]] = row
    return out


def _provenance(engines: dict[str, dict]) -> str:
    seen = sorted({f"{r['measured_on'].replace('NVIDIA ', '')}, {r['measured_at']}" for r in engines.values()})
    return "; ".join(seen)


def _floor_of(engines: dict[str, dict]) -> float | None:
    main = engines.get("ours") or next(iter(engines.values()))
    return main.get("floor_gib")


def _cells(name: str, row: dict[str, dict], engines: list[str]) -> dict[str, str]:
    """Every column of one scenario row, by header."""
    peak = {e: row[e]["peak_alloc_gib"] if e in row else None for e in engines}
    floor, ours = _floor_of(row), peak.get("ours")
    cells = {"row": f"`{name}`", "floor": _g(floor)}
    cells.update({f"peak {ENGINE_LABEL[e]}": _g(peak[e]) for e in engines})
    cells["ours ÷ upstream"] = _ratio(ours, peak.get("upstream"))
    cells["ours ÷ FSDP2"] = _ratio(ours, peak.get("fsdp2"))
    cells["ours ÷ floor"] = _ratio(ours, floor)
    cells.update({f"step {ENGINE_LABEL[e]}": _g(row[e]["step_s"] if e in row else None, 3) for e in engines})
    cells["measured on"] = _provenance(row)
    return cells


def family_table(scenarios: dict[str, dict[str, dict]], engines: list[str]) -> list[str]:
    """One row per scenario: floor, peaks per engine, ratios, step times per engine, where and when measured;
    a column with no figure in any row is left out."""
    rows = [_cells(name, row, engines) for name, row in scenarios.items()]
    heads = [h for h in rows[0] if any(r[h] != "–" for r in rows)]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(r[h] for h in heads) + " |" for r in rows]
    return lines


def commands(scenarios: dict[str, dict[str, dict]]) -> list[str]:
    """The commands that measure each row again (engines of one configuration share one command)."""
    lines = ["```bash"]
    for name, row in scenarios.items():
        grouped: dict[str, list[str]] = defaultdict(list)
        for engine_row in row.values():
            impl = engine_row["command"].split("--impl ", 1)[1].split(" ", 1)[0]
            grouped[engine_row["command"].replace(f"--impl {impl} ", "--impl {} ", 1)].append(impl)
        lines.append(f"# {name}")
        lines += [template.replace("{}", ",".join(impls), 1) for template, impls in grouped.items()]
    return [*lines, "```"]


def family_section(kind: str, method: str, rows: list[dict]) -> list[str]:
    """One scenario family: what is measured, the table, the commands."""
    scenarios = by_scenario(rows)
    present = {r["engine"] for r in rows}
    engines = [e for e in summary.ENGINES if e in present]
    unit = "Peaks and floors in GiB per rank, steps in seconds."
    return [
        f"## {TITLES[kind]} (`{kind}`)",
        "",
        f"{method} {unit}",
        "",
        *family_table(scenarios, engines),
        "",
        *commands(scenarios),
        "",
    ]


def figures_block(rows: list[dict]) -> list[str]:
    """The headline figures: peak allocated GiB and step seconds per engine, and the floor."""
    scenarios = by_scenario(rows)
    lines = [
        "<!-- figures:begin -->",
        "| configuration | floor GiB | ours GiB | FSDP2 GiB | upstream GiB | ours s/step | FSDP2 s/step | "
        "upstream s/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, what in HEADLINES:
        row = scenarios.get(name, {})
        if not row:
            continue
        peak = [_g(row[e]["peak_alloc_gib"]) if e in row else "–" for e in ("ours", "fsdp2", "upstream")]
        step = [_g(row[e]["step_s"], 3) if e in row else "–" for e in ("ours", "fsdp2", "upstream")]
        lines.append(f"| {what} (`{name}`) | {_g(_floor_of(row))} | " + " | ".join(peak + step) + " |")
    cards = sorted(
        {r["measured_on"].replace("NVIDIA ", "") for n, _ in HEADLINES for r in scenarios.get(n, {}).values()}
    )
    lines += [
        "",
        f"Peak allocated device memory per rank and step time, measured on {', '.join(cards)}; "
        "`docs/benchmarks.md` defines the terms and has every row.",
        "<!-- figures:end -->",
    ]
    return lines


def render(data: dict) -> str:
    """The whole page."""
    rows = data["rows"]
    cards = sorted({r["measured_on"] for r in rows})
    out = [
        "# Benchmarks",
        "",
        "<!-- Generated by `python benchmarks/report.py` from benchmarks/results/summary.json; do not edit. -->",
        "",
        "Device memory and step time of this package against upstream DeepSpeed 0.19.8 and PyTorch FSDP2 on the "
        f"same models, configs and batches, one configuration per process, measured on {', '.join(cards)}. Each "
        "row below is the latest measurement of its configuration; `benchmarks/results/` holds the raw records "
        "and `benchmarks/README.md` explains how to run and add measurements.",
        "",
        "## Headline figures",
        "",
        *figures_block(rows),
        "",
        "## Terms",
        "",
        TERMS.format(floors=_floor_table()),
        "",
        "## Reproducing a row",
        "",
        "Each section ends with the command that measures its rows again (`OUT` is any empty folder). On a machine "
        "without a package index, carry `.whl_upstream/` and run `bash benchmarks/device_run.sh` with the same "
        "arguments but `--out`. `python benchmarks/summary.py --add OUT/results.jsonl` folds a new measurement "
        "into the record, and `python benchmarks/report.py` regenerates this page.",
        "",
    ]
    grouped: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        grouped[row["family"]].append(row)
    for kind in ORDER:
        if kind in grouped:
            out += family_section(kind, data["methods"][kind], grouped[kind])
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """CLI (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--summary", type=Path, default=summary.SUMMARY)
    ap.add_argument("--md", type=Path, default=DOCS)
    ap.add_argument("--check", action="store_true", help="compare with --md instead of writing it")
    a = ap.parse_args(argv)
    text = render(json.loads(a.summary.read_text()))
    if a.check:
        same = a.md.exists() and a.md.read_text() == text
        print(f"{a.md}: {'up to date' if same else 'stale: run python benchmarks/report.py'}")
        return 0 if same else 1
    a.md.write_text(text)
    print(f"{a.md}: {len(text.splitlines())} lines")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
