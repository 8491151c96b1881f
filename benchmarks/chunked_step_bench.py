"""Time one optimizer step of an fp32 master: plain (fp32 gradient handed over) vs the chunked step of
ZeRO-1/2 (bf16 gradient converted chunk by chunk, [Note: chunked step]).

    python3 benchmarks/chunked_step_bench.py --numel 1420000000 --chunk 500000000

Prints the median of several timed steps (CUDA events around each) and the peak memory of each variant.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deepspeed._core.optim.chunked_step import step_in_chunks
from deepspeed.ops.adam import FusedAdam


def _time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=1_420_000_000)
    ap.add_argument("--chunk", type=int, default=500_000_000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    master = torch.nn.Parameter(torch.randn(args.numel, device="cuda"), requires_grad=False)
    opt = FusedAdam([master], lr=1e-4, weight_decay=0.01)
    grad16 = torch.randn(args.numel, device="cuda").bfloat16()
    rows = {}

    def plain() -> None:
        master.grad = grad16.float()
        opt.step()
        master.grad = None

    def chunked() -> None:
        step_in_chunks(opt, 0, grad16, args.chunk)

    for name, fn in (("plain_full_fp32_copy", plain), ("chunked", chunked)):
        fn()  # warm-up (state creation, kernel build)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = _time(fn, args.reps)
        rows[name] = {
            "ms": round(ms, 2),
            "peak_over_base_gib": round((torch.cuda.max_memory_allocated() - base) / 2**30, 2),
        }
    print(json.dumps({"numel": args.numel, "chunk": args.chunk, **rows}))


if __name__ == "__main__":
    main()
