"""Where one training step's time goes: forward / backward / optimizer step, host vs device (a diagnostic).

Each spec runs in its own process (the S1 model unless ``spec["model"]`` says otherwise; N=1 unless
``spec["world_size"]`` asks for rank 0 of PyTorch's fake group, where collectives cost nothing):

    python benchmarks/profile_phases.py --spec '{"impl": "ours", "stage": 2, "dtype": "bf16"}' --out DIR
    python benchmarks/profile_phases.py --compare A.json B.json [--md OUT.md]

Spec keys besides impl/stage/dtype/model: ``micro_batch`` (1), ``seq`` (the model config's sequence length
overridden through ``dataclasses.replace``; the replaced config is registered in ``models.MODELS`` under
``<model>@seq<seq>`` so ``make_trainer``, ``build_model`` and ``random_batch`` all see it), ``warmup`` (3),
``steps`` (8), ``profile_steps`` (2), ``ds_config`` (``"hf_auto"``: scenario S3's HF-"auto" DeepSpeed config,
``_harness.hf_auto_config``, instead of ``_harness.ds_config``; FSDP2 ignores it), ``zero`` (keys merged into that
config's ``zero_optimization``, for A/B runs of one switch), ``tag`` (appended to the output name),
``checkpoint_reentrant`` (default ``_harness.default_checkpoint_reentrant``), ``cprofile`` (``profile_steps``
more steps under cProfile: ``python_profile``, host time per Python function, ``cprofile_top`` rows,
default 40). The timed steps also record device
memory: allocated when a step starts (after the warm-up), peak allocated and reserved over the timed steps.

After ``warmup`` steps it times ``steps`` steps with a device sync after each phase (so the phases add up to
more than an unsynchronised step), then profiles ``profile_steps`` more full steps with ``torch.profiler`` (CPU and,
when there is a GPU, CUDA activity) and keeps the operators with the most device time and the most host time, the
number of kernel launches per phase, and a ``summary`` (see :func:`summarise`): wall time, GPU busy time as the
union of device-activity intervals, idle gaps, host-device synchronisations, op counts, copy kernels, per-phase
host/device time. Without CUDA the device fields are 0 or None (the CPU smoke test runs ``quick-qwen``).
Writes ``DIR/<impl>_z<stage>_<tokens>tok[_n<N>][_<tag>].json`` (tokens = micro_batch x seq). Not a timed test; figures
come only from the run that wrote them. ``--compare`` prints a side-by-side table of two such files (A, B, A/B).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import models
from _harness import (
    DeepSpeedTrainer,
    default_checkpoint_reentrant,
    device,
    hf_auto_config,
    init_process_group,
    mem,
    reset_peak,
    sync,
)
from models import build_model, random_batch
from trainers import make_trainer

GAP_US = 50.0  # idle gaps on the device longer than this are counted
LAUNCH_PATTERNS = ("LaunchKernel", "cudaGraphLaunch")  # cudaLaunchKernel, cudaLaunchKernelExC, cuLaunchKernel(Ex)
SYNC_PATTERNS = {
    "cudaStreamSynchronize": ("cudaStreamSynchronize",),
    "cudaDeviceSynchronize": ("cudaDeviceSynchronize",),
    "cudaEventSynchronize": ("cudaEventSynchronize",),
    "aten::item": ("aten::item",),
    "aten::_local_scalar_dense": ("aten::_local_scalar_dense",),
}
"""Host-device synchronisations, matched by substring; plus ``cudaMemcpy*`` without ``Async`` (the sync ones)."""
BLOCKING_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy (sync)")
"""The runtime calls in which the host waits; their host time adds up to ``syncs.blocking_host_ms`` (``aten::item``
and ``_local_scalar_dense`` contain one of them, so they are listed but not added)."""
OP_PATTERNS = {
    "aten::slice": ("aten::slice",),
    "aten::copy_": ("aten::copy_",),
    "aten::cat": ("aten::cat",),
    "AccumulateGrad": ("AccumulateGrad",),  # "AccumulateGrad" or "torch::autograd::AccumulateGrad"
    "hook_nodes": ("_PostBackward", "PostBackward", "PreBackward", "BackwardHook", "_RoutedUse"),
    "fsdp_regions": ("FSDP::",),
    "record_param_comms": ("record_param_comms",),
    "nccl_host": ("nccl",),
}
"""Host-side (CPU) events per category, matched by substring of the event name."""
USER_MARKS = ("phase:", "profile_step#", "ProfilerStep")
EVALUATE_WRAPPER = "autograd::engine::evaluate_function:"
DEVICE_ACTIVITIES = ("kernel", "memcpy", "memset")


def _top(events: list, key: str, n: int = 12) -> list[dict]:
    rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:n]
    return [
        {
            "name": e.key[:90],
            "calls": e.count,
            "self_device_ms": round(e.self_device_time_total / 1e3, 2),
            "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2),
        }
        for e in rows
    ]


# ----------------------------------------------------------------------------------------------- summary helpers
def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of half-open ``[start, end)`` intervals as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def _clip(merged: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in merged if b > lo and a < hi]


def _length(merged: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in merged)


def _on_device(e: Any) -> bool:
    kind = getattr(getattr(e, "device_type", None), "name", str(getattr(e, "device_type", "")))
    return kind not in ("CPU", "")


def _is_device(e: Any) -> bool:
    """A device activity that keeps the GPU busy: kernel, memcpy, memset (by kineto's activity type where the event
    has one; GPU user annotations and CUDA sync records on the device lanes are left out)."""
    if not _on_device(e):
        return False
    activity = str(getattr(e, "activity_type", None) or "").lower()
    if activity:
        return any(k in activity for k in DEVICE_ACTIVITIES)
    return not _is_user_mark(e.name) and not getattr(e, "is_user_annotation", False)


def _is_user_mark(name: str) -> bool:
    return name.startswith(USER_MARKS)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    """``aten::`` patterns match the op exactly (``aten::slice`` is not ``aten::slice_backward``), others by
    substring; the autograd engine's ``evaluate_function: <node>`` wrappers are left out (the node is counted)."""
    if name.startswith(EVALUATE_WRAPPER):
        return False
    return any(name == p if p.startswith("aten::") else p in name for p in patterns)


def _ms(us: float) -> float:
    return round(us / 1e3, 3)


def _count_rows(averages: list, patterns: dict[str, tuple[str, ...]]) -> dict[str, dict]:
    """Per category: calls, host time (total, children included) and the matched names with their calls."""
    out: dict[str, dict] = {}
    for label, pats in patterns.items():
        rows = [e for e in averages if _matches(e.key, pats) and not _is_user_mark(e.key)]
        out[label] = {
            "count": int(sum(e.count for e in rows)),
            "host_ms": _ms(sum(e.cpu_time_total for e in rows)),
            "matched": {e.key[:80]: int(e.count) for e in rows},
        }
    return out


def summarise(events: list, averages: list, wall_s: float, has_device: bool) -> dict:
    """The ``summary`` section from a profile of whole steps (``profile_step#i`` / ``phase:*`` user marks).

    - ``wall_ms``: first step mark's start to the last one's end (host clock of the trace); ``wall_perf_ms`` the same
      window by ``time.perf_counter`` (with a device sync on both sides).
    - ``device_busy_ms``: union of the device-activity intervals (kernels, memcpy, memset; GPU user annotations left
      out) inside the window; ``busy_fraction`` = busy / wall. ``gaps``: idle stretches > 50 µs (the leading and
      trailing ones in the window included), count and total, and the 10 largest, each with the innermost CPU op
      open on the host when it began and the phase it began in.
    - ``syncs``: host-device synchronisations (calls, host ms, matched names); ``blocking_sync_calls`` and
      ``blocking_host_ms`` add only the runtime waits (``BLOCKING_SYNCS``; an ``aten::item`` on CUDA is one
      ``cudaStreamSynchronize`` inside ``_local_scalar_dense``), ``scalar_reads`` the ``_local_scalar_dense`` calls.
    - ``kernel_launches``, ``ops`` (``OP_PATTERNS``), ``copy_kernels`` (device events whose name contains
      "copy"/"memcpy", case-insensitive: ``direct_copy_kernel``, ``CatArrayBatchedCopy``, ``Memcpy DtoD`` ...),
      ``nccl_kernels``.
    - ``phases``: per phase (summed over the profiled steps) host ms of the mark, device ms of the kernels launched
      under it (``launched_device_ms``), and device busy ms inside its host window (``busy_in_window_ms``; work
      launched late in one phase can run in the next one's window).
    """
    host = [e for e in events if not _on_device(e)]
    dev = [e for e in events if _is_device(e)] if has_device else []
    activity_types: dict[str, int] = {}
    for e in events:
        if _on_device(e):
            key = str(getattr(e, "activity_type", None) or "?")
            activity_types[key] = activity_types.get(key, 0) + 1
    steps = [e for e in host if e.name.startswith("profile_step#")]
    lo = min((e.time_range.start for e in steps), default=0.0)
    hi = max((e.time_range.end for e in steps), default=0.0)
    wall_us = hi - lo
    busy = _clip(merge_intervals([(e.time_range.start, e.time_range.end) for e in dev]), lo, hi)
    busy_us = _length(busy)

    marks = sorted((e for e in host if e.name.startswith("phase:")), key=lambda e: e.time_range.start)
    ops = sorted(
        (e for e in host if not _is_user_mark(e.name) and e.time_range.end > e.time_range.start),
        key=lambda e: e.time_range.start,
    )
    starts = [e.time_range.start for e in ops]

    def cpu_op_at(t: float) -> str | None:
        # innermost op open at t: scan back from the last op that started before t (bounded look-back)
        i = bisect.bisect_right(starts, t) - 1
        for j in range(i, max(-1, i - 5000), -1):
            if ops[j].time_range.end >= t:
                return ops[j].name[:90]
        return None

    def phase_at(t: float) -> str | None:
        for m in marks:
            if m.time_range.start <= t < m.time_range.end:
                return m.name
        return None

    gaps: list[tuple[float, float]] = []
    if has_device and wall_us > 0:
        edges = [lo] + [x for iv in busy for x in iv] + [hi]
        gaps = [(edges[k], edges[k + 1]) for k in range(0, len(edges), 2) if edges[k + 1] - edges[k] > GAP_US]
    largest = sorted(gaps, key=lambda g: g[1] - g[0], reverse=True)[:10]

    memcpy_sync = [e for e in averages if e.key.startswith("cudaMemcpy") and "Async" not in e.key]
    syncs = _count_rows(averages, SYNC_PATTERNS)
    syncs["cudaMemcpy (sync)"] = {
        "count": int(sum(e.count for e in memcpy_sync)),
        "host_ms": _ms(sum(e.cpu_time_total for e in memcpy_sync)),
        "matched": {e.key: int(e.count) for e in memcpy_sync},
    }
    launches = [e for e in averages if _matches(e.key, LAUNCH_PATTERNS)]
    copies = [e for e in dev if "copy" in e.name.lower()]
    by_copy: dict[str, list[float]] = {}
    for e in copies:
        row = by_copy.setdefault(e.name[:80], [0, 0.0])
        row[0] += 1
        row[1] += e.time_range.end - e.time_range.start
    nccl = [e for e in dev if "nccl" in e.name.lower()]

    phases: dict[str, dict] = {}
    for m in marks:
        row = phases.setdefault(
            m.name.removeprefix("phase:"), {"host_ms": 0.0, "launched_device_ms": 0.0, "busy_in_window_ms": 0.0}
        )
        row["host_ms"] += _ms(m.time_range.end - m.time_range.start)
        # the host mark's kernels (its children's included); key_averages would add the GPU annotation's span
        row["launched_device_ms"] += _ms(m.device_time_total) if has_device else 0.0
        row["busy_in_window_ms"] += _ms(_length(_clip(busy, m.time_range.start, m.time_range.end)))
    for row in phases.values():
        for key in row:
            row[key] = round(row[key], 3)
        if not has_device:
            row["busy_in_window_ms"] = row["launched_device_ms"] = None

    return {
        "profiled_steps": len(steps),
        "has_device": has_device,
        "wall_ms": _ms(wall_us),
        "wall_perf_ms": round(wall_s * 1e3, 3),
        "device_busy_ms": _ms(busy_us) if has_device else None,
        "busy_fraction": round(busy_us / wall_us, 4) if has_device and wall_us > 0 else None,
        "device_events": len(dev),
        "device_activity_types": activity_types,
        "gaps": {
            "threshold_us": GAP_US,
            "count": len(gaps),
            "total_ms": _ms(sum(b - a for a, b in gaps)),
            "largest": [
                {
                    "start_ms": _ms(a - lo),
                    "length_us": round(b - a, 1),
                    "cpu_op": cpu_op_at(a),
                    "phase": phase_at(a),
                }
                for a, b in largest
            ],
        },
        "syncs": syncs,
        "blocking_sync_calls": int(sum(syncs[k]["count"] for k in BLOCKING_SYNCS)),
        "scalar_reads": syncs["aten::_local_scalar_dense"]["count"],
        "blocking_host_ms": round(sum(syncs[k]["host_ms"] for k in BLOCKING_SYNCS), 3),
        "kernel_launches": int(sum(e.count for e in launches)),
        "kernel_launch_names": sorted({e.key for e in launches}),
        "ops": _count_rows(averages, OP_PATTERNS),
        "copy_kernels": {
            "count": len(copies),
            "device_ms": _ms(sum(v[1] for v in by_copy.values())),
            "top": [
                {"name": k, "count": v[0], "device_ms": _ms(v[1])}
                for k, v in sorted(by_copy.items(), key=lambda kv: kv[1][1], reverse=True)[:8]
            ],
        },
        "nccl_kernels": {
            "count": len(nccl),
            "device_ms": _ms(sum(e.time_range.end - e.time_range.start for e in nccl)),
        },
        "phases": phases,
    }


# ----------------------------------------------------------------------------------------------- run
def _model_name(spec: dict) -> str:
    """The model key to build (``seq`` overrides the shape's sequence length: :func:`models.with_seq`)."""
    return models.with_seq(spec.get("model", "gpt1.3b"), spec.get("seq"))


def _make_trainer(name: str, spec: dict) -> tuple[Any, Any, int]:
    if spec.get("ds_config") == "hf_auto" and spec["impl"] != "fsdp2":
        cfg = models.MODELS[name]
        model = build_model(name, device(), torch.bfloat16)
        n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        config = hf_auto_config(spec, cfg.hidden)
        config["zero_optimization"].update(spec.get("zero") or {})  # A/B of single switches
        return DeepSpeedTrainer(model, spec, config=config), cfg, n
    return make_trainer(name, spec)


def _python_profile(trainer: Any, ids: torch.Tensor, labels: torch.Tensor, steps: int, top: int = 40) -> dict:
    """``steps`` more steps under ``cProfile`` (``spec["cprofile"]``): host time per Python function, to say which
    of our functions the host time of the hooks goes to. cProfile slows every Python call, so the times are for
    ranking, not for adding up against the step."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    sync()
    prof.enable()
    for _ in range(steps):
        trainer.backward(trainer.loss(ids, labels))
        trainer.step()
    sync()
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive calls, tottime, cumtime, callers)

    def rows(index: int) -> list[dict]:
        ranked = sorted(stats.items(), key=lambda item: item[1][index], reverse=True)[:top]
        return [
            {
                "function": f"{'/'.join(Path(file).parts[-2:])}:{line}({name})",
                "calls": value[0],
                "self_ms": round(value[2] * 1e3, 2),
                "cum_ms": round(value[3] * 1e3, 2),
            }
            for (file, line, name), value in ranked
        ]

    return {"steps": steps, "by_self": rows(2), "by_cumulative": rows(3)}


def run(spec: dict) -> dict:
    # World size > 1: rank 0 of PyTorch's fake group (collectives cost nothing: the profile is overhead only).
    init_process_group(spec["impl"], int(spec.get("world_size", 1)))
    models.CHECKPOINT_USE_REENTRANT = default_checkpoint_reentrant(spec)
    name = _model_name(spec)
    micro_batch = int(spec.get("micro_batch", 1))
    spec = {**spec, "micro_batch": micro_batch}  # the DeepSpeed configs read it
    trainer, cfg, n_params = _make_trainer(name, spec)
    ids, labels = random_batch(cfg, micro_batch, device(), seed=0)
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": [], "unsynced_step": []}

    def step(timed: bool, synced: bool = True) -> None:
        t0 = time.perf_counter()
        loss = trainer.loss(ids, labels)
        if synced:
            sync()
        t1 = time.perf_counter()
        trainer.backward(loss)
        if synced:
            sync()
        t2 = time.perf_counter()
        trainer.step()
        sync()
        t3 = time.perf_counter()
        if timed and synced:
            phases["forward"].append(t1 - t0)
            phases["backward"].append(t2 - t1)
            phases["step"].append(t3 - t2)
        elif timed:
            phases["unsynced_step"].append(t3 - t0)

    for _ in range(int(spec.get("warmup", 3))):
        step(False)
    sync()
    reset_peak()
    resident = mem()["alloc"]  # what a step starts from: model states and whatever outlives a step
    for _ in range(int(spec.get("steps", 8))):
        step(True)
        step(True, synced=False)
    sync()
    counters = mem()
    memory = {
        "alloc_at_step_start_gib": round(resident, 4),
        "peak_alloc_gib": round(counters["peak_alloc"], 4),
        "peak_reserved_gib": round(counters["peak_reserved"], 4),
        "alloc_retries": counters["alloc_retries"],
    }
    from torch.profiler import ProfilerActivity, profile, record_function

    has_device = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if has_device else [])
    sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for i in range(int(spec.get("profile_steps", 2))):
            with record_function(f"profile_step#{i}"):
                with record_function("phase:forward"):
                    loss = trainer.loss(ids, labels)
                with record_function("phase:backward"):
                    trainer.backward(loss)
                with record_function("phase:step"):
                    trainer.step()
                sync()
        wall_s = time.perf_counter() - t0
    events = prof.key_averages()
    summary = summarise(list(prof.events()), list(events), wall_s, has_device)
    python_profile = None
    if spec.get("cprofile"):
        python_profile = _python_profile(
            trainer, ids, labels, int(spec.get("profile_steps", 2)), int(spec.get("cprofile_top", 40))
        )
    phase_rows = {
        e.key: {"cpu_ms": round(e.cpu_time_total / 1e3, 2), "device_ms": round(e.device_time_total / 1e3, 2)}
        for e in events
        if e.key.startswith("phase:")
    }
    return {
        "spec": spec,
        "model_config": cfg.to_dict(),
        "tokens_per_step": micro_batch * cfg.seq,
        "params": n_params,
        "checkpoint_reentrant": models.CHECKPOINT_USE_REENTRANT,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "median_s": {k: round(statistics.median(v), 4) for k, v in phases.items() if v},
        "all_s": {k: [round(x, 4) for x in v] for k, v in phases.items()},
        "profiled_phases": phase_rows,
        "kernel_launches": summary["kernel_launches"],
        "memory": memory,
        "summary": summary,
        "top_device": _top(list(events), "self_device_time_total"),
        "top_cpu": _top(list(events), "self_cpu_time_total"),
        "python_profile": python_profile,
    }


# ----------------------------------------------------------------------------------------------- compare
def _flat(summary: dict) -> dict[str, Any]:
    """The scalar fields of a summary, nested keys joined by '.' (lists and name lists left out)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            if prefix.endswith(".matched"):
                return
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif not prefix.endswith(".matched") and not isinstance(value, (list, str)):
            out[prefix] = value

    walk("", summary)
    return out


def _label(rec: dict) -> str:
    spec = rec["spec"]
    return f"{spec.get('impl')} z{spec.get('stage')}" + (f" {spec['tag']}" if spec.get("tag") else "")


def _compared(rec: dict) -> dict:
    """The fields the table shows: step medians and memory (outside the profiler), then the profile summary."""
    return {"median_s": rec.get("median_s", {}), "memory": rec.get("memory", {}), **rec.get("summary", {})}


def compare(a: dict, b: dict) -> str:
    """Markdown table of two records' summaries: field, A, B, A/B."""
    label_a, label_b = _label(a), _label(b)
    fa, fb = _flat(_compared(a)), _flat(_compared(b))
    lines = [
        f"Profile: {label_a} vs {label_b}, {a.get('tokens_per_step')} / {b.get('tokens_per_step')} tokens per step, "
        f"model {a['spec'].get('model')}",
        "",
        f"| field | {label_a} | {label_b} | ratio |",
        "|---|---:|---:|---:|",
    ]
    for key in list(fa) + [k for k in fb if k not in fa]:
        va, vb = fa.get(key), fb.get(key)
        num = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (va, vb))
        ratio = f"{va / vb:.2f}" if num and vb else "-"
        lines.append(f"| {key} | {va} | {vb} | {ratio} |")
    for label, rec in ((label_a, a), (label_b, b)):
        gaps = rec.get("summary", {}).get("gaps", {}).get("largest", [])
        if gaps:
            lines += ["", f"Largest idle gaps, {label}:", ""]
            lines += [f"- {g['length_us']} us at {g['start_ms']} ms ({g['phase']}): {g['cpu_op']}" for g in gaps]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec")
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2, metavar=("A_JSON", "B_JSON"))
    ap.add_argument("--md", help="with --compare: also write the table here")
    args = ap.parse_args()
    if args.compare:
        records = [json.loads(Path(p).read_text()) for p in args.compare]
        table = compare(*records)
        print(table, end="")
        if args.md:
            Path(args.md).write_text(table)
        return
    if not (args.spec and args.out):
        ap.error("--spec and --out (or --compare A B)")
    spec = json.loads(args.spec)
    os.makedirs(args.out, exist_ok=True)
    result = run(spec)
    tag = f"_{spec['tag']}" if spec.get("tag") else ""
    ws = int(spec.get("world_size", 1))
    wide = f"_n{ws}" if ws > 1 else ""
    name = f"{spec['impl']}_z{spec.get('stage')}_{result['tokens_per_step']}tok{wide}{tag}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(result, f, indent=1)
    s = result["summary"]
    print(
        json.dumps(
            {
                "file": name,
                "spec": spec,
                "median_s": result["median_s"],
                "wall_ms": s["wall_ms"],
                "busy_fraction": s["busy_fraction"],
                "gaps": [s["gaps"]["count"], s["gaps"]["total_ms"]],
                "blocking_syncs": s["blocking_sync_calls"],
                "scalar_reads": s["scalar_reads"],
                "launches": s["kernel_launches"],
                "phases": s["phases"],
            }
        )
    )


if __name__ == "__main__":
    main()
