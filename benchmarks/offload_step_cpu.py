"""Host side of an offloaded optimizer step, on the CPU alone: where the time goes (a diagnostic).

    PYTHONPATH=. python benchmarks/offload_step_cpu.py --numel 134217728 --chunk 16777216

Times, on an fp32 master with ``DeepSpeedCPUAdam``: ``plain`` (an fp32 gradient handed over, one step),
``chunked`` (a bf16 ``ChunkedGradShard`` stepped by ``step_in_chunks``, as offloaded ZeRO-3 does), and the
bf16->fp32 conversion of every chunk into a fresh tensor per chunk (``convert_fresh``) vs one reused buffer
(``convert_reused``); and one backward's folds into a bf16 shard whose chunks are allocated afresh
(``fill_fresh``, as each step did before [Note: kept host chunks]) vs kept from the previous step
(``fill_kept``); and one chunk converted and scaled in one go (``convert_scale_whole``) vs block by block
(``convert_scale_blocked``, what ``step_in_chunks`` does on the host); and the gradient norm over the bf16
shard upcast into a fresh tensor per piece (``norm_fresh``) vs through one reused buffer (``norm_reused``,
``local_sq_norm``); and a step's reads of gradients parked in host-resident parameter shards (``offload_param``,
[Note: parked grads]): copied into a staging buffer and then converted (``parked_copy_convert``) vs converted
straight from the shards (``parked_convert_into``). Each figure is the median of ``--reps`` runs after one
warm-up run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deepspeed._core.grads.accumulator import KEPT_CHUNKS, ChunkedGradShard
from deepspeed._core.optim.chunked_step import step_in_chunks
from deepspeed.ops.adam import DeepSpeedCPUAdam


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=128 << 20)
    ap.add_argument("--chunk", type=int, default=16 << 20)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    n, ch = args.numel, args.chunk
    torch.manual_seed(0)
    master = torch.nn.Parameter(torch.randn(n), requires_grad=False)
    opt = DeepSpeedCPUAdam([master], lr=1e-3)

    def shard() -> ChunkedGradShard:
        acc = ChunkedGradShard(n, ch, torch.bfloat16, "cpu")
        for s in range(0, n, ch):
            acc.add_(s, torch.randn(min(ch, n - s)).bfloat16())
        return acc

    def plain() -> float:
        g = torch.randn(n)
        t = time.perf_counter()
        g.mul_(0.5)
        master.grad = g
        opt.step()
        master.grad = None
        return time.perf_counter() - t

    def chunked() -> float:
        acc = shard()
        t = time.perf_counter()
        step_in_chunks(opt, 0, acc, ch, 0.5, consume=True)
        return time.perf_counter() - t

    def convert(reuse: bool) -> float:
        acc = shard()
        buf = torch.empty(ch)
        t = time.perf_counter()
        for s in range(0, n, ch):
            w = acc.window(s, min(s + ch, n))
            x = buf[: w.numel()].copy_(w) if reuse else w.to(torch.float32, copy=True)
            x.mul_(0.5)
        return time.perf_counter() - t

    kept = ChunkedGradShard(n, ch, torch.bfloat16, "cpu", KEPT_CHUNKS)
    incoming = torch.randn(ch).bfloat16()

    def fill(shard: ChunkedGradShard) -> float:
        """One backward's worth of folds into a bf16 shard, then the window ends."""
        t = time.perf_counter()
        for s in range(0, n, ch):
            shard.add_(s, incoming[: min(ch, n - s)])
        elapsed = time.perf_counter() - t
        shard.reset()
        return elapsed

    from deepspeed._core.grads import convert as convert_mod

    src_chunk, out_chunk = torch.randn(ch).bfloat16(), torch.empty(ch)

    def convert_scale(block: int) -> float:
        """One chunk converted to fp32 and scaled: whole (two memory passes) or block by block (cached)."""
        saved, convert_mod.CONVERT_BLOCK_NUMEL = convert_mod.CONVERT_BLOCK_NUMEL, block
        try:
            t = time.perf_counter()
            convert_mod.convert_scaled(out_chunk, src_chunk, 0.5)
            return time.perf_counter() - t
        finally:
            convert_mod.CONVERT_BLOCK_NUMEL = saved

    from deepspeed._core.optim.clipping import NORM_CHUNK_NUMEL, local_sq_norm

    norm_shard = shard()

    def norm(reused: bool) -> float:
        """Sum of squares of the bf16 shard: ``local_sq_norm`` (one reused, cache-sized upcast buffer) vs a
        fresh fp32 tensor per 8M-element piece (what it did before)."""
        chunks = norm_shard.allocated()
        t = time.perf_counter()
        if reused:
            local_sq_norm(chunks)
        else:
            total = torch.zeros(())
            for c in chunks:
                for start in range(0, c.numel(), NORM_CHUNK_NUMEL):
                    piece = c[start : start + NORM_CHUNK_NUMEL].float()
                    total += torch.dot(piece, piece)
        return time.perf_counter() - t

    from types import SimpleNamespace

    from deepspeed._core.grads.parked import Parked, ParkedWindow

    region_numel = 4 << 20  # about one 3B-model matrix per region
    parked_regions = [
        Parked(SimpleNamespace(shard=torch.randn(min(region_numel, n - o)).bfloat16(), ds_id=o), 0, o)
        for o in range(0, n, region_numel)
    ]
    empty_acc = ChunkedGradShard(n, ch, torch.bfloat16, "cpu")
    staging = [torch.empty(ch, dtype=torch.bfloat16) for _ in range(2)]

    def parked(direct: bool) -> float:
        window = ParkedWindow(empty_acc, parked_regions, staging, ch, n)
        t = time.perf_counter()
        for s in range(0, n, ch):
            e = min(s + ch, n)
            if direct:
                window.convert_into(s, e, out_chunk[: e - s], 0.5)
            else:
                convert_mod.convert_scaled(out_chunk[: e - s], window.window(s, e), 0.5)
        return time.perf_counter() - t

    cases = {
        "parked_copy_convert": lambda: parked(False),
        "parked_convert_into": lambda: parked(True),
        "plain": plain,
        "chunked": chunked,
        "norm_fresh": lambda: norm(False),
        "norm_reused": lambda: norm(True),
        "convert_scale_whole": lambda: convert_scale(1 << 62),
        "convert_scale_blocked": lambda: convert_scale(convert_mod.CONVERT_BLOCK_NUMEL),
        "convert_fresh": lambda: convert(False),
        "convert_reused": lambda: convert(True),
        "fill_fresh": lambda: fill(ChunkedGradShard(n, ch, torch.bfloat16, "cpu")),
        "fill_kept": lambda: fill(kept),
    }
    out = {"numel": n, "chunk": ch, "threads": torch.get_num_threads(), "torch": torch.__version__}
    for name, fn in cases.items():
        fn()
        out[name + "_s"] = round(statistics.median(fn() for _ in range(args.reps)), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
