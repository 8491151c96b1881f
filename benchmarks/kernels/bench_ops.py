"""Build, check and time deepspeed-lean's native ops on a CUDA machine (written for one H200).

Run from the repository root (no install needed; needs torch, numpy is not used, ninja, nvcc, g++):

    python benchmarks/kernels/bench_ops.py --out benchmarks/results

Steps: print the environment (ds_report), JIT-build the ops (timed), run every CUDA correctness check
from tests/kernels/cuda_checks.py (fresh random data, poisoned outputs), then time with CUDA events
(warm-up, medians; "ms" is per call with calls back to back, "ms (1 call)" one call on an idle GPU):
  * device copy bandwidth (one large D2D copy; bytes read + written),
  * multi-tensor flatten / unflatten of 1,000 mixed-size tensors vs torch.cat,
    torch._utils._flatten_dense_tensors and torch._foreach_copy_ (GB/s and fraction of copy bandwidth),
  * FusedAdam (our kernel) vs torch.optim.AdamW(fused=True),
  * DeepSpeedCPUAdam (our kernel) vs torch CPU AdamW (for-loop, foreach, fused) at the same thread count.
Writes <out>/bench_ops.jsonl (one JSON object per measurement) and <out>/bench_ops.md, and prints the
table last. Targets (issue 7): flatten/unflatten >= 85% of copy bandwidth and faster than torch.cat;
fused Adam >= torch fused AdamW; CPU Adam >= 3x torch CPU AdamW.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("DS_ACCELERATOR", "cuda")

RESULTS: list[dict] = []


def record(kind: str, name: str, **fields: object) -> dict:
    """Append one measurement (also printed as it happens)."""
    row = {"kind": kind, "name": name, **fields}
    RESULTS.append(row)
    print(json.dumps(row), flush=True)
    return row


def cuda_time_ms(fn: Callable[[], object], warmup: int, reps: int, batch: int = 10) -> tuple[float, float]:
    """(throughput ms, single-call ms), both medians from CUDA events.

    Throughput: ``batch`` calls back to back between two events, divided by ``batch`` (CPU launch work
    overlaps the GPU, as in a training step). Single call: one call on an idle GPU, launch cost included.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    singles, batched = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        singles.append(start.elapsed_time(end))
    for _ in range(max(3, reps // batch)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        batched.append(start.elapsed_time(end) / batch)
    return statistics.median(batched), statistics.median(singles)


def cpu_time_ms(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median wall-clock milliseconds of one call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def build_ops() -> dict:
    """JIT-build the three native ops (timed) and return their modules."""
    from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder, UtilsBuilder

    modules = {}
    for cls in (UtilsBuilder, FusedAdamBuilder, CPUAdamBuilder):
        builder = cls()
        t0 = time.time()
        try:
            modules[builder.NAME] = builder.load(verbose=False)
            record("build", builder.NAME, ok=True, seconds=round(time.time() - t0, 1))
        except Exception as err:  # noqa: BLE001 (a failed build is reported, the rest still runs)
            record("build", builder.NAME, ok=False, error=f"{type(err).__name__}: {err}")
    return modules


def run_checks() -> bool:
    """Every function in tests/kernels/cuda_checks.py; returns True when all pass."""
    spec = importlib.util.spec_from_file_location("cuda_checks", REPO / "tests" / "kernels" / "cuda_checks.py")
    checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks)
    ok = True
    for check in checks.ALL_CHECKS:
        t0 = time.time()
        try:
            check("cuda")
            record("check", check.__name__, ok=True, seconds=round(time.time() - t0, 2))
        except Exception as err:  # noqa: BLE001 (every check runs and reports)
            ok = False
            record(
                "check",
                check.__name__,
                ok=False,
                error=f"{type(err).__name__}: {err}",
                trace=traceback.format_exc()[-2000:],
            )
    return ok


def mixed_sizes(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """n odd-ish sizes, log-uniform in [lo, hi]."""
    rng = random.Random(seed)
    return [round(lo * (hi / lo) ** rng.random()) | 1 for _ in range(n)]


def bench_copy(total_bytes: int, args: argparse.Namespace) -> float:
    """Device copy bandwidth (GB/s, bytes read + written) for a buffer of total_bytes."""
    src = torch.empty(total_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms, single = cuda_time_ms(lambda: dst.copy_(src), args.warmup, args.reps)
    gbs = 2 * total_bytes / ms / 1e6
    record(
        "bandwidth", "d2d_copy", bytes=total_bytes, ms=round(ms, 4), ms_single_call=round(single, 4), gb_s=round(gbs, 1)
    )
    return gbs


def bench_flatten(modules: dict, copy_gbs: float, args: argparse.Namespace, dtype: torch.dtype, aligned: bool) -> None:
    """1,000 mixed-size tensors: flatten and unflatten, ours vs torch."""
    utils = modules["utils"]
    sizes = mixed_sizes(args.num_tensors, 1_000, args.max_numel, seed=11)
    tensors = [torch.randn(n, device="cuda").to(dtype) for n in sizes]
    offsets, nxt = [], 0
    for n in sizes:
        offsets.append(nxt)
        nxt += (n + 7) // 8 * 8 if aligned else n
    out = torch.empty(nxt, dtype=dtype, device="cuda")
    moved = 2 * sum(sizes) * out.element_size()
    views = [out.narrow(0, o, n) for o, n in zip(offsets, sizes, strict=True)]
    tag = f"{str(dtype).split('.')[-1]}_{'aligned16' if aligned else 'packed'}"
    candidates = {
        "ours_flatten_into": lambda: utils.flatten_into(tensors, out, offsets),
        "torch_cat": lambda: torch.cat(tensors),
        "torch_flatten_dense_tensors": lambda: torch._utils._flatten_dense_tensors(tensors),
        "torch_foreach_copy_into": lambda: torch._foreach_copy_(views, tensors),
        "ours_unflatten_from": lambda: utils.unflatten_from(out, tensors, offsets),
        "torch_foreach_copy_out": lambda: torch._foreach_copy_(tensors, views),
    }
    for name, fn in candidates.items():
        ms, single = cuda_time_ms(fn, args.warmup, args.reps)
        gbs = moved / ms / 1e6
        record(
            "flatten",
            f"{name}[{tag}]",
            tensors=len(sizes),
            bytes_moved=moved,
            ms=round(ms, 4),
            ms_single_call=round(single, 4),
            gb_s=round(gbs, 1),
            frac_copy_bw=round(gbs / copy_gbs, 3),
        )


def _adam_setup(dtype: torch.dtype, sizes: list[int]) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    ours = [torch.nn.Parameter(torch.randn(n, device="cuda").to(dtype)) for n in sizes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, ref, strict=True):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
    return ours, ref


def bench_fused_adam(modules: dict, copy_gbs: float, args: argparse.Namespace, dtype: torch.dtype) -> None:
    """One optimizer step over many params: FusedAdam (ours) vs torch AdamW(fused=True) and foreach."""
    from deepspeed.ops.adam import FusedAdam

    sizes = mixed_sizes(args.adam_tensors, 1_000, args.adam_max_numel, seed=5)
    ours, ref = _adam_setup(dtype, sizes)
    numel = sum(sizes)
    moved = numel * torch.tensor([], dtype=dtype).element_size() * 7  # read p, g, m, v; write p, m, v
    opt = FusedAdam(ours, lr=1e-4, weight_decay=0.01)
    fused = torch.optim.AdamW(ref, lr=1e-4, weight_decay=0.01, fused=True)
    foreach = torch.optim.AdamW(ref, lr=1e-4, weight_decay=0.01, foreach=True)
    kernel = modules.get("fused_adam")
    opt.step()  # creates the state so the raw-kernel timing can reuse it
    lists = [
        [p.grad for p in ours],
        list(ours),
        [opt.state[p]["exp_avg"] for p in ours],
        [opt.state[p]["exp_avg_sq"] for p in ours],
    ]
    noop = torch.zeros(1, dtype=torch.int32, device="cuda")
    candidates = {
        "ours_FusedAdam.step": opt.step,
        "ours_multi_tensor_adam_raw": lambda: kernel.multi_tensor_adam(
            65536, noop, lists, 1e-4, 0.9, 0.999, 1e-8, 10, 1, 1, 0.01
        ),
        "torch_AdamW_fused": fused.step,
        "torch_AdamW_foreach": foreach.step,
    }
    tag = str(dtype).split(".")[-1]
    for name, fn in candidates.items():
        ms, single = cuda_time_ms(fn, args.warmup, max(10, args.reps // 3), batch=5)
        gbs = moved / ms / 1e6
        record(
            "fused_adam",
            f"{name}[{tag}]",
            params=len(sizes),
            numel=numel,
            ms=round(ms, 4),
            ms_single_call=round(single, 4),
            gb_s=round(gbs, 1),
            frac_copy_bw=round(gbs / copy_gbs, 3),
        )


def bench_cpu_adam(args: argparse.Namespace) -> None:
    """DeepSpeedCPUAdam vs torch CPU AdamW variants, same thread count, one big + many small params: fp32, and
    bf16 parameters with bf16 states (the 16-bit offloaded state)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.set_num_threads(args.cpu_threads)
    sizes = [args.cpu_numel] + [4096] * 64

    def setup(dtype: torch.dtype) -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in sizes]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        return ps

    bf16 = torch.bfloat16
    variants = {
        "ours_DeepSpeedCPUAdam": (torch.float32, lambda ps: DeepSpeedCPUAdam(ps, lr=1e-4, weight_decay=0.01)),
        "torch_AdamW_default": (torch.float32, lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01)),
        "torch_AdamW_foreach": (
            torch.float32,
            lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, foreach=True),
        ),
        "torch_AdamW_fused": (torch.float32, lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True)),
        "ours_DeepSpeedCPUAdam_bf16_states": (
            bf16,
            lambda ps: DeepSpeedCPUAdam(ps, lr=1e-4, weight_decay=0.01, fp32_optimizer_states=False),
        ),
        "torch_AdamW_fused_bf16": (bf16, lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True)),
    }
    timings = {}
    for name, (dtype, make) in variants.items():
        opt = make(setup(dtype))
        if name.startswith("ours") and opt.ds_opt_adam is None:
            record("cpu_adam", name, ok=False, error="native kernel not loaded")
            continue
        try:
            timings[name] = (dtype, cpu_time_ms(opt.step, 2, args.cpu_reps))
        except Exception as err:  # noqa: BLE001 (older torch may lack a variant)
            record("cpu_adam", name, ok=False, error=f"{type(err).__name__}: {err}")
    base = timings.get("torch_AdamW_default", (None, None))[1]
    for name, (dtype, ms) in timings.items():
        record(
            "cpu_adam",
            name,
            dtype=str(dtype).split(".")[-1],
            threads=args.cpu_threads,
            numel=sum(sizes),
            ms=round(ms, 3),
            speedup_vs_torch_default=round(base / ms, 2) if base else None,
        )


def bench_offload_step(args: argparse.Namespace) -> None:
    """The offloaded step's host work on one fp32 master with a bf16 gradient and a bf16 copy for the accelerator:
    the one-pass kernel (``step_scaled``) against the general route (convert and scale the gradient into an fp32
    buffer, step, round the master into the copy)."""
    from deepspeed._core.grads.convert import convert_scaled
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.set_num_threads(args.cpu_threads)
    n = args.cpu_numel
    gen = torch.Generator().manual_seed(0)
    master = torch.nn.Parameter(torch.randn(n, generator=gen))
    grad = torch.randn(n, generator=gen).bfloat16()
    copy = torch.empty(n, dtype=torch.bfloat16)
    opt = DeepSpeedCPUAdam([master], lr=1e-4, weight_decay=0.01)
    if opt.ds_opt_adam is None:
        record("offload_step", "one_pass", ok=False, error="native kernel not loaded")
        return
    buffer = torch.empty(n)

    def general() -> None:
        convert_scaled(buffer, grad, 0.5)
        master.grad = buffer
        opt.step()
        copy.copy_(master.detach())

    timings = {
        "one_pass": cpu_time_ms(lambda: opt.step_scaled(grad, 0.5, copy), 2, args.cpu_reps),
        "general_route": cpu_time_ms(general, 2, args.cpu_reps),
    }
    for name, ms in timings.items():
        record(
            "offload_step",
            name,
            threads=args.cpu_threads,
            numel=n,
            ms=round(ms, 3),
            speedup_vs_general_route=round(timings["general_route"] / ms, 2),
        )


def write_reports(out_dir: Path) -> str:
    """JSON lines + markdown table; returns the table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "bench_ops.jsonl", "w") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in RESULTS)
    lines = [
        "| kind | name | ms | ms (1 call) | GB/s | frac copy BW | speedup | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in RESULTS:
        if r["kind"] == "check" and r.get("ok"):
            continue
        speedup = r.get("speedup_vs_torch_default", r.get("speedup_vs_general_route", ""))
        lines.append(
            f"| {r['kind']} | {r['name']} | {r.get('ms', '')} | {r.get('ms_single_call', '')} | {r.get('gb_s', '')} | "
            f"{r.get('frac_copy_bw', '')} | {speedup} | "
            f"{r.get('ok', '')}{' ' + r['error'][:120] if r.get('error') else ''} |"
        )
    passed = sum(1 for r in RESULTS if r["kind"] == "check" and r.get("ok"))
    total = sum(1 for r in RESULTS if r["kind"] == "check")
    table = f"CUDA checks passed: {passed}/{total}\n\n" + "\n".join(lines) + "\n"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu only"
    (out_dir / "bench_ops.md").write_text(f"# bench_ops ({device}, torch {torch.__version__})\n\n" + table)
    return table


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--num-tensors", type=int, default=1000)
    p.add_argument("--max-numel", type=int, default=4_000_000)
    p.add_argument("--adam-tensors", type=int, default=300)
    p.add_argument("--adam-max-numel", type=int, default=16_000_000)
    p.add_argument("--cpu-threads", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--cpu-numel", type=int, default=50_000_000)
    p.add_argument("--cpu-reps", type=int, default=10)
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--checks-only", action="store_true")
    p.add_argument("--cpu-only", action="store_true", help="only the CPU Adam comparison (runs without a GPU)")
    return p.parse_args()


def main() -> int:
    """Run everything; exit status 1 when a check failed."""
    args = parse_args()
    if args.cpu_only:
        bench_cpu_adam(args)
        bench_offload_step(args)
        print("\n" + write_reports(Path(args.out)))
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device visible; this script is for the GPU machine", file=sys.stderr)
        return 2
    from deepspeed import env_report

    env_report.main()
    modules = build_ops()
    ok = True if args.skip_checks else run_checks()
    if not args.checks_only:
        total = 0
        for n in mixed_sizes(args.num_tensors, 1_000, args.max_numel, seed=11):
            total += 2 * n  # bf16 bytes
        copy_gbs = bench_copy(total, args)
        if "utils" in modules:
            for dtype, aligned in ((torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)):
                bench_flatten(modules, copy_gbs, args, dtype, aligned)
                torch.cuda.empty_cache()
        if "fused_adam" in modules:
            for dtype in (torch.float32, torch.bfloat16):
                bench_fused_adam(modules, copy_gbs, args, dtype)
                torch.cuda.empty_cache()
        bench_cpu_adam(args)
        bench_offload_step(args)
    print("\n" + write_reports(Path(args.out)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
