"""Attribute a training step's peak device memory to the code that allocated it (CUDA only).

    python benchmarks/diagnose_step_peak.py --spec '{"impl": "ours", "stage": 1, "dtype": "bf16", "gas": 1,
        "world_size": 1, "model": "gpt1.3b"}' --out DIR

Runs two warm-up steps, then records PyTorch's allocator history over one step, replays the trace to find the
moment of peak allocation, and writes ``DIR/<name>.json``: the peak, the live bytes at that moment grouped by the
innermost frame inside this repository / the model / torch.optim (so a newcomer sees *which line* holds what),
the largest live blocks with their stacks, and the category totals of
``deepspeed/tools/profiling/memory_timeline`` when that package is present. This is a diagnostic for the
benchmarks' "where ours is not ahead" notes, not a benchmark: the recorded step runs slower than an untraced one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import torch  # noqa: E402

from _harness import MEMORY_TIMELINE_DIR, device, init_process_group, load_memory_timeline, warm_up_deepspeed  # noqa: E402
from models import random_batch  # noqa: E402
from trainers import make_trainer  # noqa: E402

GiB = float(1 << 30)
_INTERESTING = ("deepspeed", "benchmarks/models.py", "torch/optim", "torch/utils/checkpoint", "torch/autograd", "fsdp")


def _site(frames: list[dict]) -> str:
    """The innermost frame worth naming: ours/upstream/model/optimizer code, else the innermost one."""
    for f in frames:
        name = f.get("filename", "")
        if any(k in name for k in _INTERESTING):
            short = name.split("site-packages/")[-1].split("/work/main/")[-1]
            return f"{short}:{f.get('line')} {f.get('name')}"
    return frames[0].get("name", "?") if frames else "<no frames>"


def live_at_peak(trace: list[dict]) -> tuple[int, int, dict[int, tuple[int, list[dict]]]]:
    """Replay ``trace``: (peak bytes, entry index of the peak, live blocks {addr: (size, frames)} there)."""
    live: dict[int, tuple[int, list[dict]]] = {}
    total = peak = peak_at = 0
    best: dict[int, tuple[int, list[dict]]] = {}
    for i, e in enumerate(trace):
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
            total += e["size"]
            if total > peak:
                peak, peak_at, best = total, i, dict(live)
        elif action == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    return peak, peak_at, best


def _timeline_module():
    if not os.path.exists(os.path.join(MEMORY_TIMELINE_DIR, "__init__.py")):
        return None
    return load_memory_timeline("memory_timeline_standalone")


def run(spec: dict, out: Path) -> dict:
    """Warm up, trace one step, attribute its peak; returns the record written to ``out``."""
    init_process_group(spec["impl"], int(spec.get("world_size", 1)))
    warm_up_deepspeed(spec["impl"])
    gas = int(spec.get("gas", 1))
    trainer, cfg, n_params = make_trainer(spec["model"], spec)
    batches = [random_batch(cfg, 1, device(), seed=m) for m in range(gas)]

    def step() -> None:
        for ids, labels in batches:
            trainer.backward(trainer.loss(ids, labels))
            trainer.step()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=1_000_000)
    step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak_counter = torch.cuda.max_memory_allocated()
    trace = snapshot["device_traces"][0]
    # Blocks allocated before recording started are the baseline every trace-relative figure sits on.
    baseline = before
    peak_rel, peak_at, blocks = live_at_peak(trace)
    by_site: dict[str, int] = defaultdict(int)
    for size, frames in blocks.values():
        by_site[_site(frames)] += size
    largest = sorted(blocks.values(), key=lambda b: -b[0])[:25]
    record = {
        "spec": spec,
        "params": n_params,
        "alloc_before_step_gib": before / GiB,
        "peak_alloc_counter_gib": peak_counter / GiB,
        "peak_from_trace_gib": (baseline + peak_rel) / GiB,
        "peak_entry": peak_at,
        "trace_entries": len(trace),
        "new_bytes_at_peak_by_site_gib": {
            k: round(v / GiB, 4) for k, v in sorted(by_site.items(), key=lambda kv: -kv[1])
        },
        "largest_new_blocks_at_peak": [
            {"gib": round(size / GiB, 4), "stack": [_site([f]) for f in frames[:12] if f.get("filename")][:8]}
            for size, frames in largest
        ],
    }
    mod = _timeline_module()
    if mod is not None:
        try:
            record["memory_timeline_summary"] = mod.summarize(snapshot)
        except Exception as exc:  # noqa: BLE001 -- the attribution above does not depend on it
            record["memory_timeline_summary"] = f"error: {type(exc).__name__}: {exc}"
    name = spec.get("name") or f"{spec['impl']}_s{spec['stage']}_{spec['dtype']}_g{gas}_n{spec.get('world_size', 1)}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(record, indent=1))
    return record


def main() -> None:
    """Entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rec = run(json.loads(a.spec), Path(a.out))
    print(
        json.dumps(
            {
                k: rec[k]
                for k in (
                    "spec",
                    "alloc_before_step_gib",
                    "peak_alloc_counter_gib",
                    "peak_from_trace_gib",
                    "new_bytes_at_peak_by_site_gib",
                )
            },
            indent=1,
        )
    )
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
