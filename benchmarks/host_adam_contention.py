"""The host Adam on a worker thread while the training thread is busy: what the offloaded update during the
backward pays for sharing the interpreter and the cores.

    PYTHONPATH=. python benchmarks/host_adam_contention.py --params 1000000000 --out OUT.jsonl

The engine's host step runs on one worker thread, chunk by chunk (``ChunkStepper.step_range`` of
``DeepSpeedCPUAdam`` over an fp32 master with a bf16 gradient, each chunk's bf16 copy rounded into one of two
page-locked staging buffers); when the update starts during the backward ([Note: early host step]) the training
thread runs autograd's Python hooks at the same time. Each chunk's kernel runs without the GIL, but the worker
needs the GIL back between chunks, and the interpreter hands it over only every ``sys.getswitchinterval()``
seconds (5 ms by default) while the other thread runs Python; the kernel's threads also share the cores with the
training thread. Each record is one configuration:

- ``chunk_mib``: fp32 bytes per step chunk (the engine's host chunk is 64 MiB);
- ``switch_ms``: the interpreter's switch interval during the run;
- ``threads``: the worker's intra-op threads (``torch.set_num_threads`` before its thread starts);
- ``busy``: whether the main thread runs a hook-like Python loop (small tensor operations and attribute work)
  until the worker ends;

with the worker's seconds for the whole update (median of ``--steps``) and, when ``busy``, the busy loop's
iterations per second relative to the same loop alone (``busy_rate``: 1.0 means the update did not slow it).
Runs on any machine (no accelerator needed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch


def _busy_iteration(small: torch.Tensor, scratch: dict) -> None:
    """One hook-like slice of Python: what an autograd hook does per parameter, roughly."""
    small.add_(1.0)
    scratch["n"] = scratch.get("n", 0) + 1
    _ = [i * 2 for i in range(20)]


def _busy_rate(seconds: float) -> float:
    """Iterations per second of the busy loop alone."""
    small, scratch, count = torch.zeros(16), {}, 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        _busy_iteration(small, scratch)
        count += 1
    return count / seconds


def _update(params: int, chunk_numel: int, threads: int, busy: bool, steps: int) -> tuple[float, float]:
    """Median worker seconds of one update and the busy loop's iterations per second during it."""
    from deepspeed._core.optim.chunked_step import ChunkStepper
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    master = torch.nn.Parameter(torch.zeros(params, dtype=torch.float32), requires_grad=False)
    grad = torch.full((params,), 1e-3, dtype=torch.bfloat16)
    opt = DeepSpeedCPUAdam([master], lr=1e-5)
    pinned = torch.cuda.is_available()
    staging = [torch.empty(chunk_numel, dtype=torch.bfloat16, pin_memory=pinned) for _ in range(2)]
    default_threads = torch.get_num_threads()
    worker = ThreadPoolExecutor(max_workers=1)
    # Per thread once initialised: the worker initialises (the get), then sets its own count; setting it also
    # changes the process-wide default, which the main thread then puts back.
    worker.submit(lambda: (torch.get_num_threads(), torch.set_num_threads(threads))).result()
    torch.set_num_threads(default_threads)
    assert worker.submit(torch.get_num_threads).result() == threads

    def stepped() -> float:
        start = time.perf_counter()
        stepper = ChunkStepper(opt, 0, chunk_numel)
        try:
            for i, (a, b) in enumerate(stepper.ranges()):
                stepper.step_range(a, b, grad, 1.0, copy_out=staging[i % 2][: b - a])
        finally:
            stepper.close()
        return time.perf_counter() - start

    worker.submit(stepped).result()  # warm-up: the optimizer's state and the worker's thread pool
    times, rates = [], []
    small, scratch = torch.zeros(16), {}
    for _ in range(steps):
        job = worker.submit(stepped)
        if busy:
            count, start = 0, time.perf_counter()
            while not job.done():
                _busy_iteration(small, scratch)
                count += 1
            rates.append(count / (time.perf_counter() - start))
        times.append(job.result())
    worker.shutdown()
    return statistics.median(times), statistics.median(rates) if rates else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1_000_000_000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--chunk-mib", default="64,256", help="fp32 MiB per chunk, comma-separated")
    parser.add_argument("--switch-ms", default="5,0.5", help="switch intervals, comma-separated")
    parser.add_argument("--threads", default="", help="worker threads, comma-separated (default: all, all-2)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cores = torch.get_num_threads()
    thread_counts = [int(t) for t in args.threads.split(",")] if args.threads else sorted({cores, max(1, cores - 2)})
    alone = _busy_rate(1.0)
    default_switch = sys.getswitchinterval()
    records = []
    configs = [(64, 5.0, cores, False)]  # the update alone, as the floor measures it
    for chunk_mib in (int(c) for c in args.chunk_mib.split(",")):
        for switch_ms in (float(s) for s in args.switch_ms.split(",")):
            for threads in thread_counts:
                configs.append((chunk_mib, switch_ms, threads, True))
    for chunk_mib, switch_ms, threads, busy in configs:
        sys.setswitchinterval(switch_ms / 1000.0)
        try:
            seconds, rate = _update(args.params, chunk_mib * (1 << 20) // 4, threads, busy, args.steps)
        finally:
            sys.setswitchinterval(default_switch)
        record = {
            "case": "host_adam_contention",
            "params": args.params,
            "chunk_mib": chunk_mib,
            "switch_ms": switch_ms,
            "threads": threads,
            "busy": busy,
            "seconds": round(seconds, 4),
            "busy_rate": round(rate / alone, 3) if busy else None,
            "cores": cores,
        }
        records.append(record)
        print(json.dumps(record), flush=True)
    if args.out is not None:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":
    main()
