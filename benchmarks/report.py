"""Turn benchmark JSON lines into the markdown report (docs/benchmarks.md) and, with matplotlib, one PNG of plots.

    python benchmarks/report.py benchmarks/results/*.jsonl --md docs/benchmarks.md --plots-dir benchmarks/results \
        --command "<the command that produced the JSON lines>" [--notes benchmarks/results/NOTES.md] \
        [--summary benchmarks/results/summary.json]

Several files may be given; a later record of the same configuration (scenario, impl, stage, dtype, GAS, world
size) replaces an earlier one, so a re-run of a few failed configurations can be layered over a full run. Every
number in the tables is read from those files; floors are the model-state formulas of ZeRO:
stage 0 16P; ZeRO-1 (bp+bg)P + 12P/N; ZeRO-2 bp·P + (bg+12)P/N; ZeRO-3 16P/N; FSDP2 (all sharded) 16P/N, with
bp = bg = 2 bytes (bf16/fp16 parameters and gradients, fp32 Adam state K = 12). S3 records carry their own floors
(``scenarios/s3_zero3.floors``: the offloaded variants too) and are keyed also by model and offload. With
``--summary`` the page ends with every row of that ``summary.json`` (``summary.py``), one table per run.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

GiB = float(1 << 30)
IMPLS = ("ours", "ours_leanoff", "upstream", "fsdp2")
BUCKET_ELEMS = 5e8  # reduce_bucket_size in the configs (harness.ds_config)


# ------------------------------------------------------------------------------------------------ floors
def state_floor_gib(stage: int | None, n: int, params: int, bp: int = 2, bg: int = 2, k: int = 12) -> float:
    """Model-state floor per GPU (memory_targets.md); ``stage=None`` is FSDP2 (everything sharded, fp32 params)."""
    if stage is None:
        per = 16.0 / n
    else:
        per = {0: bp + bg + k, 1: bp + bg + k / n, 2: bp + (bg + k) / n, 3: (bp + bg + k) / n}[stage]
    return per * params / GiB


def init_floor_gib(stage: int | None, n: int, params: int, chunk_elems: float = 5e8, bp: int = 2) -> float:
    """Device floor during initialise: working params + fp32 master partition + one chunk (report 2 target)."""
    if stage is None:
        return 4 * params / GiB  # FSDP2 keeps fp32 params only; optimizer state is created at the first step
    return (bp * params + 4 * params / n + bp * min(chunk_elems, params)) / GiB


def bucket_gib(double: bool = True, elem_bytes: int = 2) -> float:
    """One reduce bucket (×2 when double-buffered by overlap_comm)."""
    return BUCKET_ELEMS * elem_bytes * (2 if double else 1) / GiB


# ------------------------------------------------------------------------------------------------ loading
def config_key(r: dict) -> tuple:
    """Identity of a configuration (S3 also by model and offload: one worker each)."""
    return (
        r.get("scenario"),
        r.get("impl"),
        r.get("stage"),
        r.get("dtype"),
        r.get("gas"),
        r.get("world_size"),
        r.get("model"),
        bool(r.get("offload")),
        bool(r.get("offload_param")),
    )


def load(paths: Iterable[Path]) -> list[dict]:
    """Records of every file, later files replacing earlier records of the same configuration."""
    merged: dict[tuple, dict] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                rec["_source"] = Path(path).name
                merged[config_key(rec)] = rec
    return list(merged.values())


def _ok(records: list[dict], **match: object) -> dict | None:
    for r in records:
        if r.get("status") == "ok" and all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def _find(records: list[dict], **match: object) -> dict | None:
    for r in records:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def _f(x: float | None, nd: int = 2) -> str:
    return "—" if x is None else f"{x:.{nd}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or b in (None, 0) else f"{a / b:.2f}"


def _cell(records: list[dict], field: str, nd: int = 2, **match: object) -> tuple[str, float | None]:
    r = _find(records, **match)
    if r is None:
        return "not run", None
    if r.get("status") != "ok":
        return f"**{r.get('status')}**", None
    v = r.get(field)
    mark = " ‡" if r.get("skipped_steps") else ""  # some step was skipped (fp16 overflow): see the note
    return _f(v, nd) + mark, v


# ------------------------------------------------------------------------------------------------ tables
def s1_table(records: list[dict]) -> list[str]:
    """Peak over one step per configuration, with ratios to upstream, FSDP2 and the floor."""
    rows = sorted(
        {(r["world_size"], r["dtype"], r["gas"]) for r in records if r.get("scenario") == "s1"},
        key=lambda t: (t[0], t[1] != "bf16", t[2]),
    )
    out = [
        "| N | dtype | GAS | stage | floor GiB | ours peak alloc / reserved | lean-off | upstream "
        "| FSDP2 (bf16, sharded) |"
        " ours/upstream | ours/FSDP2 | ours/floor | lean-off/floor | upstream/floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ws, dtype, gas in rows:
        fsdp = _find(records, scenario="s1", impl="fsdp2", world_size=ws, dtype=dtype, gas=gas)
        for stage in (1, 2):
            cells, peaks = {}, {}
            for impl in ("ours", "ours_leanoff", "upstream"):
                a, av = _cell(
                    records,
                    "peak_alloc_gib",
                    scenario="s1",
                    impl=impl,
                    stage=stage,
                    world_size=ws,
                    dtype=dtype,
                    gas=gas,
                )
                b, _ = _cell(
                    records,
                    "peak_reserved_gib",
                    scenario="s1",
                    impl=impl,
                    stage=stage,
                    world_size=ws,
                    dtype=dtype,
                    gas=gas,
                )
                cells[impl] = a if av is None else f"{a} / {b.replace(' ‡', '')}"
                peaks[impl] = av
            fa = fsdp.get("peak_alloc_gib") if fsdp and fsdp.get("status") == "ok" else None
            fcell = (
                "—"
                if fsdp is None
                else (f"{fa:.2f} / {fsdp['peak_reserved_gib']:.2f}" if fa is not None else f"**{fsdp.get('status')}**")
            )
            ref = next((r for r in records if r.get("scenario") == "s1" and r.get("params")), None)
            floor = state_floor_gib(stage, ws, ref["params"]) if ref else None
            out.append(
                f"| {ws} | {dtype} | {gas} | {stage} | {_f(floor)} | {cells['ours']} | {cells['ours_leanoff']} | "
                f"{cells['upstream']} | {fcell} | {_ratio(peaks['ours'], peaks['upstream'])} | "
                f"{_ratio(peaks['ours'], fa)} | {_ratio(peaks['ours'], floor)} | "
                f"{_ratio(peaks['ours_leanoff'], floor)} | {_ratio(peaks['upstream'], floor)} |"
            )
    return out


def s1_gas_growth(records: list[dict]) -> list[str]:
    """peak(GAS=max) − peak(GAS=1) per implementation, against one (double-buffered) reduce bucket."""
    out = [
        f"| N | dtype | stage | impl | peak GAS=1 | peak GAS=max | growth GiB | ≤ one bucket ({bucket_gib():.2f} GiB, "
        "double-buffered)? | max alloc between micro-steps | steady drift (step k+1 − k) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    combos = sorted(
        {(r["world_size"], r["dtype"], r.get("stage"), r["impl"]) for r in records if r.get("scenario") == "s1"},
        key=lambda t: (t[0], t[1] != "bf16", str(t[2]), IMPLS.index(t[3])),
    )
    for ws, dtype, stage, impl in combos:
        runs = {
            r["gas"]: r
            for r in records
            if r.get("scenario") == "s1"
            and r.get("status") == "ok"
            and (r["world_size"], r["dtype"], r.get("stage"), r["impl"]) == (ws, dtype, stage, impl)
        }
        if 1 not in runs or len(runs) < 2:
            continue
        gmax = max(runs)
        g = runs[gmax]["peak_alloc_gib"] - runs[1]["peak_alloc_gib"]
        between = runs[gmax].get("alloc_between_micro_max_gib")
        out.append(
            f"| {ws} | {dtype} | {stage if stage is not None else 'FSDP2'} | {impl} | "
            f"{runs[1]['peak_alloc_gib']:.2f} | {runs[gmax]['peak_alloc_gib']:.2f} (G={gmax}) | {g:+.2f} | "
            f"{'yes' if g <= bucket_gib() else 'NO'} | {_f(between)} | {runs[gmax].get('steady_drift_gib', 0):+.3f} |"
        )
    return out


def s2_table(records: list[dict]) -> list[str]:
    """Initialisation: device peak, reserved − allocated, host RSS, wall time."""
    out = [
        "| N | stage | impl | params (B) | init peak alloc GiB (× param bytes) | init floor GiB | peak/floor | "
        "reserved − alloc after init GiB (% of param bytes) | host RSS growth peak / end GiB | init wall s | "
        "first-step peak GiB | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    recs = sorted(
        (r for r in records if r.get("scenario") == "s2"),
        key=lambda r: (r["world_size"], str(r.get("stage")), IMPLS.index(r["impl"])),
    )
    for r in recs:
        st = r.get("stage")
        if r.get("status") != "ok":
            out.append(
                f"| {r['world_size']} | {st} | {r['impl']} | | | | | | | | | **{r.get('status')}**: "
                f"{str(r.get('error', ''))[:120]} |"
            )
            continue
        pbytes = r["params"] * r.get("param_dtype_bytes", 2) / GiB
        floor = init_floor_gib(st, r["world_size"], r["params"])
        slack = r["reserved_minus_alloc_after_init_gib"]
        out.append(
            f"| {r['world_size']} | {st if st is not None else 'FSDP2'} | {r['impl']} | {r['params'] / 1e9:.2f} | "
            f"{r['init_peak_alloc_gib']:.2f} ({r['init_peak_alloc_gib'] / pbytes:.2f}×) | {floor:.2f} | "
            f"{r['init_peak_alloc_gib'] / floor:.2f} | {slack:.2f} ({100 * slack / pbytes:.1f}%) | "
            f"{r['host_rss_peak_growth_gib']:.2f} / {r['host_rss_growth_gib']:.2f} | {r['init_wall_s']:.2f} | "
            f"{r['first_step_peak_alloc_gib']:.2f} | ok |"
        )
    return out


def throughput_table(records: list[dict]) -> list[str]:
    """Tokens/s per stage and implementation (solo runs)."""
    out = [
        "| stage | ours tok/s | lean-off tok/s | upstream tok/s | FSDP2 tok/s | ours/upstream | ours/FSDP2 | "
        "ours peak GiB | upstream peak GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fs = _find(records, scenario="throughput", impl="fsdp2")
    fv = fs.get("tokens_per_s") if fs and fs.get("status") == "ok" else None
    for stage in (0, 1, 2, 3):
        c = {
            impl: _cell(records, "tokens_per_s", 0, scenario="throughput", impl=impl, stage=stage)
            for impl in ("ours", "ours_leanoff", "upstream")
        }
        for impl in c:  # † = reentrant activation checkpointing (the note under the table)
            r = _find(records, scenario="throughput", impl=impl, stage=stage)
            if r is not None and r.get("checkpoint_reentrant") and r.get("status") == "ok":
                c[impl] = (c[impl][0] + " †", c[impl][1])
        pk = {
            impl: _cell(records, "peak_alloc_gib", 2, scenario="throughput", impl=impl, stage=stage)[0]
            for impl in ("ours", "upstream")
        }
        fcell = "—" if fs is None else (f"{fv:.0f}" if fv is not None else f"**{fs.get('status')}**")
        out.append(
            f"| {stage} | {c['ours'][0]} | {c['ours_leanoff'][0] if stage else 'n/a'} | {c['upstream'][0]} | "
            f"{fcell} | {_ratio(c['ours'][1], c['upstream'][1])} | {_ratio(c['ours'][1], fv)} | "
            f"{pk['ours']} | {pk['upstream']} |"
        )
    return out


S3_IMPL_ORDER = ("ours", "ours_leanoff", "upstream", "fsdp2")


def checkpoint_mode(r: dict) -> str:
    """The activation-checkpoint form of a record: ``reentrant`` or ``non-reentrant`` (records written before the
    field existed ran the non-reentrant form unless their spec said otherwise)."""
    return "reentrant" if r.get("checkpoint_reentrant") else "non-reentrant"


def _s3_group(r: dict) -> tuple:
    return (r.get("model"), r.get("world_size"), bool(r.get("offload")))


def _s3_sort(r: dict) -> tuple:
    return (
        str(r.get("model")),
        r.get("world_size") or 0,
        bool(r.get("offload")),
        bool(r.get("offload_param")),
        r.get("stage") == 2,
        S3_IMPL_ORDER.index(r["impl"]) if r.get("impl") in S3_IMPL_ORDER else 9,
    )


def _s3_ref(records: list[dict], r: dict, impl: str) -> dict | None:
    """The ok ZeRO-3 (or FSDP2) record of ``impl`` for the same model, N and optimizer offload."""
    for o in records:
        if (
            o.get("scenario") == "s3"
            and o.get("status") == "ok"
            and o.get("impl") == impl
            and _s3_group(o) == _s3_group(r)
            and not o.get("offload_param")
            and o.get("stage") != 2
        ):
            return o
    return None


def _i(x: object) -> str:
    return "—" if x is None else str(x)


def _s3_trace_cells(r: dict) -> tuple[str, str]:
    t = r.get("trace") or {}
    if "skipped" in t or not t:
        return "—", "—"
    if t.get("error") and "gathered_layers_alive_max_from_trace" not in t:
        return "err", "err"
    d = t.get("deferred_frees") or {}
    delay = d.get("max_delay_us")
    frees = (
        "—"
        if not d
        else (
            f"{d.get('count', '?')} ({d.get('gathered_count', '?')} gathered"
            + (f", max {delay / 1000:.1f} ms)" if delay is not None else ")")
        )
    )
    return _f(t.get("gathered_layers_alive_max_from_trace")), frees


def _s3_ratio(r: dict, other: dict | None) -> str:
    """Peak-allocated ratio of ``r`` to ``other`` (none for itself or for the ZeRO-2 row)."""
    if other is None or other is r or r.get("stage") == 2:
        return "—"
    return _ratio(r.get("peak_alloc_gib"), other.get("peak_alloc_gib"))


def _s3_invalid(r: dict) -> bool:
    """A run whose every step was skipped (fake-group garbage tripping an overflow check) never built optimizer
    state, so its memory figures are not comparable."""
    return bool(r.get("skipped_steps")) and r["skipped_steps"] >= int(r.get("warmup_steps") or 0) + 1


def s3_table(records: list[dict]) -> list[str]:
    """One row per S3 configuration: peak vs floor, gathered layers (hooks, trace), deferred frees, host, time."""
    recs = sorted((r for r in records if r.get("scenario") == "s3" and r.get("impl") in S3_IMPL_ORDER), key=_s3_sort)
    out = [
        (
            "| model | N | offload | impl | stage | ckpt | peak alloc / reserved GiB | floor GiB | peak/floor | "
            "reserved/alloc | gathered layers fwd / bwd max (hooks) | layer-equiv fwd / bwd | from trace | deferred "
            "frees | host B/owned param | step s | retries | vs upstream | vs FSDP2 |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        off = ("opt+param" if r.get("offload_param") else "opt") if r.get("offload") else "—"
        st = "FSDP2" if r.get("impl") == "fsdp2" else r.get("stage")
        head = f"| {r.get('model')} | {r.get('world_size')} | {off} | {r['impl']} | {st} | {checkpoint_mode(r)} |"
        if r.get("status") != "ok":
            err = str(r.get("error", r.get("skip_reason", ""))).replace("|", "\\|").replace("\n", " ")[:100]
            out.append(head + f" **{r.get('status')}**: {err} |" + " |" * 12)
            continue
        if _s3_invalid(r):
            out.append(
                head + f" **invalid**: every step skipped ({r.get('skipped_steps')}), so no optimizer state "
                f"existed (peak {_f(r.get('peak_alloc_gib'))} GiB) |" + " |" * 12
            )
            continue
        peak = r.get("peak_alloc_gib")
        up, fs = _s3_ref(records, r, "upstream"), _s3_ref(records, r, "fsdp2")
        from_trace, frees = _s3_trace_cells(r)
        out.append(
            head + f" {_f(peak)} / {_f(r.get('peak_reserved_gib'))} | {_f(r.get('floor_gib'))} | "
            f"{_f(r.get('peak_over_floor'))} | {_f(r.get('reserved_over_alloc'))} | "
            f"{_i(r.get('gathered_layers_fwd_max'))} / {_i(r.get('gathered_layers_bwd_max'))} "
            f"of {_i(r.get('layers'))} | "
            f"{_f(r.get('gathered_layer_equiv_fwd_max'))} / {_f(r.get('gathered_layer_equiv_bwd_max'))} | "
            f"{from_trace} | {frees} | {_f(host_bytes_per_owned_param(r), 1)} | {_f(r.get('step_time_s'))} | "
            f"{_i(r.get('alloc_retries'))} | {_s3_ratio(r, up)} | {_s3_ratio(r, fs)} |"
        )
    return out


def host_bytes_per_owned_param(r: dict) -> float | None:
    """Host memory growth per parameter this rank owns: the records divide by the whole model's parameters, so at
    N > 1 (a fake-group rank holding 1/N of the state) the figure is scaled by N to compare with 13.5 B/param."""
    value = r.get("host_bytes_per_param")
    return None if value is None else value * int(r.get("world_size") or 1)


def _check(ok: bool | None) -> str:
    return "n/a" if ok is None else ("yes" if ok else "**NO**")


def s3_targets(records: list[dict]) -> list[str]:
    """The issue's acceptance figures for ours, checked mechanically against the S3 records."""
    lines = []
    for r in sorted(
        (
            r
            for r in records
            if r.get("scenario") == "s3"
            and r.get("impl") == "ours"
            and r.get("status") == "ok"
            and r.get("stage") != 2
            and not _s3_invalid(r)
        ),
        key=_s3_sort,
    ):
        tag = (
            f"{r.get('model')} N={r.get('world_size')}"
            + (" offload" if r.get("offload") else "")
            + ("+param" if r.get("offload_param") else "")
        )
        limit = 1 + (r.get("prefetch_budget_layers") or 0)
        g = [r.get("gathered_layer_equiv_fwd_max"), r.get("gathered_layer_equiv_bwd_max")]
        gathered = None if None in g else max(g) <= limit + 1e-9
        fs = _s3_ref(records, r, "fsdp2")
        peak = r.get("peak_alloc_gib")
        vs_fsdp2 = None if fs is None or not peak else peak <= fs["peak_alloc_gib"]
        frees = ((r.get("trace") or {}).get("deferred_frees") or {}).get("gathered_count")
        parts = [
            (
                f"gathered layer-equivalents ≤ 1 + prefetch budget ({limit:.2f}): {_check(gathered)} "
                f"({_f(max(g) if gathered is not None else None)})"
            ),
            f"peak ≤ FSDP2's: {_check(vs_fsdp2)}",
            f"no deferred free of a gathered block (trace): {_check(None if frees is None else frees == 0)}",
        ]
        if r.get("world_size", 1) > 1 and not r.get("offload"):
            parts.append(f"peak ≤ 1.3× floor: {_check(None if not peak else r['peak_over_floor'] <= 1.3)}")
            parts.append(f"reserved ≤ 1.1× allocated: {_check(None if not peak else r['reserved_over_alloc'] <= 1.1)}")
        if r.get("offload"):
            host = host_bytes_per_owned_param(r)
            parts.append(f"host ≤ 13.5 B/param: {_check(None if host is None else host <= 13.5)} ({_f(host, 1)})")
        z2 = next(
            (
                o
                for o in records
                if o.get("scenario") == "s3"
                and o.get("impl") == "ours"
                and o.get("stage") == 2
                and o.get("status") == "ok"
                and _s3_group(o) == _s3_group(r)
            ),
            None,
        )
        if z2 is not None and not r.get("offload_param"):
            parts.append(
                f"ZeRO-3 peak ≤ ZeRO-2 peak ({_f(z2.get('peak_alloc_gib'))}): "
                f"{_check(None if not peak else peak <= z2['peak_alloc_gib'])}"
            )
        lines.append(f"- {tag}: " + "; ".join(parts))
    return lines or ["- no ok `ours` S3 record"]


def failures(records: list[dict]) -> list[str]:
    """Every configuration that did not produce a number, with its error."""
    bad = [r for r in records if r.get("status") != "ok"]
    if not bad:
        return ["None: every configuration produced a number."]
    out = ["| scenario | impl | stage | dtype | GAS | N | status | error |", "|---|---|---|---|---|---|---|---|"]
    for r in bad:
        err = str(r.get("error") or r.get("skip_reason", "")).replace("|", "\\|").replace("\n", " ")[:300]
        scen = (
            r.get("scenario")
            if r.get("scenario") != "s3"
            else f"s3 {r.get('model')}" + (" offload" if r.get("offload") else "")
        )
        out.append(
            f"| {scen} | {r.get('impl')} | {r.get('stage')} | {r.get('dtype')} | {r.get('gas', '-')} | "
            f"{r.get('world_size')} | {r.get('status')} | {err} |"
        )
    return out


def not_ahead(records: list[dict]) -> list[str]:
    """Mechanical list of the comparisons ours does not win (memory: higher peak; speed: fewer tokens/s)."""
    lines = []
    for r in records:
        if r.get("status") != "ok" or r.get("impl") != "ours" or (r["scenario"] == "s3" and _s3_invalid(r)):
            continue
        match = {k: r.get(k) for k in ("scenario", "stage", "dtype", "gas", "world_size")}
        if r["scenario"] == "s3":
            if r.get("stage") == 2 or r.get("offload_param"):
                continue
            match.update(model=r.get("model"), offload=r.get("offload"))
        for other in ("upstream", "fsdp2"):
            o = _ok(records, **dict(match, impl=other, stage=None if other == "fsdp2" else r.get("stage")))
            if o is None:
                continue
            field = {
                "s1": "peak_alloc_gib",
                "s2": "init_peak_alloc_gib",
                "throughput": "tokens_per_s",
                "s3": "peak_alloc_gib",
            }.get(r["scenario"])
            if field is None:
                continue
            a, b = r.get(field), o.get(field)
            worse = a < b if field == "tokens_per_s" else a > b
            if worse:
                scen = r["scenario"] + (
                    f" {r.get('model')}{' offload' if r.get('offload') else ''}" if r["scenario"] == "s3" else ""
                )
                lines.append(
                    f"- {scen} stage {r.get('stage')} {r.get('dtype')} GAS {r.get('gas', '-')} "
                    f"N={r.get('world_size')}: ours {field} {a:.2f} vs {other} {b:.2f}"
                )
    return lines or ["- none in these results"]


def short_table(records: list[dict]) -> str:
    """A compact plain-text summary for the end of stdout."""
    lines = ["scenario   impl          st dtype gas ws  status  main figures"]
    for r in sorted(
        records,
        key=lambda r: (
            r.get("scenario", ""),
            r.get("world_size") or 0,
            str(r.get("dtype")),
            r.get("gas") or 0,
            str(r.get("stage")),
            r.get("impl", ""),
        ),
    ):
        if r.get("status") != "ok":
            fig = str(r.get("error", r.get("skip_reason", "")))[:70]
        elif r["scenario"] == "s2":
            fig = (
                f"init_peak {r['init_peak_alloc_gib']:.2f} res-alloc {r['reserved_minus_alloc_after_init_gib']:.2f} "
                f"rss+ {r['host_rss_peak_growth_gib']:.2f} {r['init_wall_s']:.1f}s"
            )
        elif r["scenario"] == "throughput":
            fig = f"{r['tokens_per_s']:.0f} tok/s peak {r['peak_alloc_gib']:.2f}"
        elif r["scenario"] == "s3":
            fig = (
                f"{r.get('model')}{' off' if r.get('offload') else ''}{'+p' if r.get('offload_param') else ''} "
                f"peak {r.get('peak_alloc_gib', 0):.2f}/{r.get('peak_reserved_gib', 0):.2f} "
                f"gathered {r.get('gathered_layers_fwd_max')}/{r.get('gathered_layers_bwd_max')} "
                f"host {r.get('host_bytes_per_param', 0):.1f}B/p step {r.get('step_time_s', 0):.2f}s"
            )
        else:
            fig = (
                f"peak {r.get('peak_alloc_gib', 0):.2f}/{r.get('peak_reserved_gib', 0):.2f} "
                f"step {r.get('step_time_s', 0):.2f}s"
            )
        lines.append(
            f"{r.get('scenario', ''):<10} {r.get('impl', ''):<13} {r.get('stage')!s:<2} "
            f"{r.get('dtype')!s:<5} {r.get('gas', '-')!s:<3} {r.get('world_size')!s:<3} "
            f"{r.get('status', ''):<7} {fig}"
        )
    return "\n".join(lines)


def s3_section(records: list[dict]) -> list[str]:
    """The S3 part of the page: what was run, the table, the acceptance checks (or a line saying none ran)."""
    s3 = [r for r in records if r.get("scenario") == "s3"]
    if not s3:
        return ["No S3 record in these results (`run_all.py --only s3`).", ""]
    if all(r.get("status") == "skipped" for r in s3):
        return ["Not measured: every S3 record is `skipped` (stage 3 was not available in that build).", ""]
    counts = sorted({len(r["step_times_s"]) for r in s3 if r.get("step_times_s")})
    timing = (
        f"Peak and retries: the measured step (untraced); step time: the median of {'/'.join(map(str, counts))} "
        "timed steps (the measured one and the plain steps after it)"
        if counts
        else "Peak, step time and retries: the measured step (untraced)"
    )
    intro = (
        "Qwen2-shaped decoders with random weights (`benchmarks/models.py`), sequence 512, micro-batch 1, bf16, "
        "activation checkpointing inside every decoder layer; DeepSpeed config = HF Trainer's `auto` values "
        "(prefetch bucket 0.9·h², persistence threshold 10·h, reduce bucket h², max live / reuse distance 1e9); "
        "`opt` = `offload_optimizer` cpu (pinned), FSDP2 `CPUOffloadPolicy`. Floor = per-rank model states "
        "(16P/N; optimizer offloaded: 4P/N, FSDP2 0; ZeRO-2 row: 2P + 14P/N). " + timing + "; "
        "gathered layers: a later step with hooks at every module boundary of the decoder "
        "layers (a layer counts when any non-persistent parameter is gathered or in flight; layer-equiv = gathered "
        "elements / one layer's); `from trace` and deferred frees: the same step's CUDA memory-history trace "
        "(`deepspeed/tools/profiling/memory_timeline`). `vs upstream` / `vs FSDP2` = peak allocated ratio. "
        "`ckpt` = the activation-checkpoint form (`torch.utils.checkpoint`'s `use_reentrant`): upstream runs the "
        "reentrant form by default (its ZeRO-3 fails under the non-reentrant one on the H200 image; HF Transformers' "
        "`gradient_checkpointing_enable` also defaults to reentrant), ours and FSDP2 the non-reentrant form; "
        "`run_all.py --s3-extra '{\"checkpoint_reentrant\": ...}'` sets one form for all. Step times of the "
        "offloaded rows depend on the CPU threads the worker had (`omp_threads` in the record). `host B/owned "
        "param` = the worker's host RSS growth over the parameters it owns (all of them at N=1, 1/N at N > 1)."
    )
    return [
        intro,
        "",
        *s3_table(records),
        "",
        "### Report 3's targets for ours (mechanical)",
        "",
        *s3_targets(records),
        "",
    ]


# ------------------------------------------------------------------------------------------------ summary rows
SUMMARY_TITLE = "## Every run: one row per scenario and engine (`summary.json`)"


def summary_section(rows: list[dict]) -> list[str]:
    """The page's last section: every row of ``summary.json`` (``benchmarks/summary.py``), one table per run."""
    out = [
        SUMMARY_TITLE,
        "",
        (
            "Generated from `benchmarks/results/summary.json`, which `benchmarks/summary.py` writes from the raw "
            "records of every committed run (the command is in `benchmarks/results/COMMANDS.txt`). The scenario "
            "names are explained in `benchmarks/README.md`; the engines measured on one configuration share its "
            "name. Peaks: over one optimizer step (S2 and init: over `initialize`); step: the record's (median) "
            "step time; tokens/s: the record's, else tokens per step / step. — = not measured or not run; each "
            "run's own notes above say how it was run (alone or beside other workers, real or fake group)."
        ),
        "",
    ]
    runs: dict[str, list[dict]] = {}
    for row in rows:
        runs.setdefault(row["run"], []).append(row)
    for run, run_rows in runs.items():
        out += [
            f"### `{run}`",
            "",
            (
                "| scenario | engine | step s | tokens/s | peak alloc GiB | peak reserved GiB | alloc after init GiB "
                "| reserved after init GiB |"
            ),
            "|---|---|---|---|---|---|---|---|",
        ]
        out += [
            f"| {r['scenario']} | {r['engine']} | {_f(r['step_s'], 3)} | {_f(r['tokens_per_s'], 0)} | "
            f"{_f(r['peak_alloc_gib'])} | {_f(r['peak_reserved_gib'])} | {_f(r['alloc_after_init_gib'])} | "
            f"{_f(r['reserved_after_init_gib'])} |"
            for r in run_rows
        ]
        out.append("")
    return out


# ------------------------------------------------------------------------------------------------ plots
def _s3_panel(ax: object, s3: list[dict]) -> None:
    """S3 bars: peak allocated (and reserved behind it) per configuration."""
    s3 = sorted(s3, key=_s3_sort)
    labels = [
        f"{r['impl']}\n{str(r.get('model')).replace('qwen', 'q')} N{r.get('world_size')}"
        f"{' off' if r.get('offload') else ''}{'+p' if r.get('offload_param') else ''}"
        f"{' z2' if r.get('stage') == 2 else ''}"
        for r in s3
    ]
    ax.bar(labels, [r.get("peak_reserved_gib") or 0 for r in s3], label="peak reserved", alpha=0.4)
    ax.bar(labels, [r.get("peak_alloc_gib") or 0 for r in s3], label="peak allocated")
    ax.set_ylabel("GiB")
    ax.set_title("S3: ZeRO-3 step peak (Qwen2 shapes)")
    ax.tick_params(axis="x", labelsize=6)
    ax.legend(fontsize=7)


def plots(records: list[dict], out_dir: Path) -> str | None:
    """One PNG (S1 peak vs GAS, S2 init peak, throughput, S3 peaks when there are S3 records); returns its file
    name, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    s3 = [r for r in records if r.get("scenario") == "s3" and r.get("status") == "ok" and not _s3_invalid(r)]
    fig, axes = plt.subplots(1, 4 if s3 else 3, figsize=(24 if s3 else 18, 5))
    if s3:
        _s3_panel(axes[3], s3)
    ax = axes[0]
    for impl in IMPLS:
        for stage in (1, 2, None):
            pts = sorted(
                (r["gas"], r["peak_alloc_gib"])
                for r in records
                if r.get("scenario") == "s1"
                and r.get("status") == "ok"
                and r["impl"] == impl
                and r.get("stage") == stage
                and r["dtype"] == "bf16"
                and r["world_size"] == 1
            )
            if pts:
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="o",
                    label=f"{impl}" + (f" z{stage}" if stage else ""),
                )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("gradient accumulation steps")
    ax.set_ylabel("peak allocated over a step (GiB)")
    ax.set_title("S1: peak vs GAS (bf16, N=1)")
    ax.legend(fontsize=7)
    ax = axes[1]
    s2 = [r for r in records if r.get("scenario") == "s2" and r.get("status") == "ok" and r["world_size"] == 1]
    ax.bar(
        [f"{r['impl']}\nz{r.get('stage') or '-'}" for r in s2],
        [r["init_peak_alloc_gib"] for r in s2],
        label="peak alloc",
    )
    ax.bar(
        [f"{r['impl']}\nz{r.get('stage') or '-'}" for r in s2],
        [r["reserved_minus_alloc_after_init_gib"] for r in s2],
        label="reserved − alloc after",
        alpha=0.7,
    )
    ax.set_ylabel("GiB")
    ax.set_title("S2: initialise (N=1)")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7)
    ax = axes[2]
    tp = [r for r in records if r.get("scenario") == "throughput" and r.get("status") == "ok"]
    ax.bar(
        [f"{r['impl']}\nz{r.get('stage') if r.get('stage') is not None else '-'}" for r in tp],
        [r["tokens_per_s"] for r in tp],
    )
    ax.set_ylabel("tokens/s")
    ax.set_title("Throughput (bf16, GAS 1, N=1, solo)")
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    name = "plots.png"
    fig.savefig(out_dir / name, dpi=90)
    return name


# ------------------------------------------------------------------------------------------------ report
def _draw_plots(records: list[dict], plots_dir: Path | None, plot_link: str | None) -> str | None:
    """The PNG the page links: drawn into ``plots_dir`` (or one found there); without ``plots_dir``, ``plot_link``
    as it is (a PNG drawn earlier from the same records)."""
    if plots_dir is None:
        return plot_link
    plot = None
    Path(plots_dir).mkdir(parents=True, exist_ok=True)
    try:
        plot = plots(records, Path(plots_dir))
    except Exception as exc:  # noqa: BLE001 -- a plotting problem must never cost the tables
        print(f"plots failed: {type(exc).__name__}: {exc}")
    if plot is None and (Path(plots_dir) / "plots.png").exists():
        plot = "plots.png"  # made where matplotlib was available (the GPU machine) from the same records
    return plot


def write_report(
    paths: list[Path],
    md_path: Path,
    command: str,
    plots_dir: Path | None = None,
    notes: Path | None = None,
    plot_link: str | None = None,
    summary: Path | None = None,
) -> None:
    """Write the markdown report of the records in ``paths``; with ``summary`` (a ``summary.json``) the page ends
    with its rows. Without ``plots_dir`` a ``plot_link`` is linked as it is (a PNG drawn earlier from the same
    records), so the page can be regenerated without redrawing."""
    records = load(paths)
    env = next((r for r in records if r.get("status") == "ok"), {})
    plot = _draw_plots(records, plots_dir, plot_link)
    ref = next((r for r in records if r.get("scenario") == "s1" and r.get("params")), None)
    lines = [
        "# Benchmarks: deepspeed-lean vs upstream DeepSpeed vs FSDP2",
        "",
        "Generated by `benchmarks/report.py` from "
        + ", ".join(f"`{Path(p).name}`" for p in paths)
        + (f" and `{Path(summary).name}` (the last section)" if summary is not None else "")
        + ".",
        "",
        "Command that produced the numbers:",
        "",
        "```",
        command,
        "```",
        "",
        f"Device: {env.get('device_name', '?')}, torch {env.get('torch', '?')}. Memory figures are the CUDA "
        "caching allocator's per-process counters (GiB = 2^30 bytes), each configuration in its own process. "
        "`ours` = deepspeed-lean with the lean switches on, `lean-off` = the same engine with "
        "`lean_inplace_flatten`/`lean_eager_grad_release`/`lean_stream_ordered_release` false, `upstream` = "
        "DeepSpeed 0.19.8 (no ops built, torch AdamW), `FSDP2` = `fully_shard` per block, fp32 params, bf16 "
        "compute. N > 1 runs use PyTorch's fake process group (rank 0 of N on one GPU: per-rank allocations "
        "are real, collectives move no data).",
        "",
    ]
    if ref:
        lines += [
            f"S1/throughput model: {ref['model']} ({ref['params'] / 1e9:.2f} B params, "
            f"{json.dumps(ref.get('model_cfg'))}), micro-batch 1, activation checkpointing per block, "
            "AdamW, clipping 1.0, buckets 5e8, overlap_comm, reduce_scatter, contiguous_gradients.",
            "",
        ]
    lines += [
        "## S1: peak memory over one optimizer step vs gradient accumulation",
        "",
        "Floor = model states only (memory_targets.md); peaks also hold activations, logits and buckets. "
        "‡ = at least one step of that run was skipped by the fp16 loss scaler (the record says how many; the "
        "measured step follows a warm-up step that was applied unless `skipped_steps` ≥ `warmup_steps`).",
        "",
    ]
    lines += s1_table(records) + ["", "### Peak growth with GAS (acceptance: ≤ one reduce bucket)", ""]
    lines += s1_gas_growth(records)
    lines += [
        "",
        "## S2: initialisation",
        "",
        "Init floor = working params (bp·P) + fp32 master partition (4P/N) + one 5e8-element chunk; FSDP2 row: "
        "its fp32 params (4P). Param bytes = P × dtype bytes of the model as built.",
        "",
    ]
    lines += s2_table(records)
    lines += ["", "## Throughput (solo runs)", ""] + throughput_table(records)
    if any(r.get("scenario") == "throughput" and r.get("checkpoint_reentrant") for r in records):
        lines += [
            "",
            "† reentrant activation checkpointing (`torch.utils.checkpoint(use_reentrant=True)`): upstream's "
            "ZeRO-3 fails under the non-reentrant form on the H200 image; every other row is non-reentrant.",
        ]
    lines += ["", "## S3: ZeRO-3 (user report 3)", ""] + s3_section(records)
    if plot:
        link = plot_link or plot
        lines += ["## Plots", "", f"![benchmarks]({link})", ""]
    else:
        lines += ["## Plots", "", "matplotlib was not importable where this report was generated: no plots.", ""]
    lines += ["## Where ours is not ahead (mechanical list)", ""] + not_ahead(records)
    lines += ["", "## Configurations without a number", ""] + failures(records)
    if notes is not None and Path(notes).exists():
        lines += ["", Path(notes).read_text().rstrip()]
    if summary is not None:
        lines += ["", *summary_section(json.loads(Path(summary).read_text()))]
        lines = lines[:-1] if lines[-1] == "" else lines
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    """CLI (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", nargs="+", type=Path)
    ap.add_argument("--md", type=Path, default=Path("docs/benchmarks.md"))
    ap.add_argument("--plots-dir", type=Path, default=None)
    ap.add_argument("--plot-link", default=None, help="path of the PNG as linked from the markdown")
    ap.add_argument("--command", required=True)
    ap.add_argument("--notes", type=Path, default=None)
    ap.add_argument("--summary", type=Path, default=None, help="summary.json whose rows end the page")
    a = ap.parse_args(argv)
    write_report(a.jsonl, a.md, a.command, a.plots_dir, a.notes, a.plot_link, a.summary)
    print(short_table(load(a.jsonl)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
