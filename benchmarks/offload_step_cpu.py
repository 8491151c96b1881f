"""Host side of an offloaded optimizer step, on the CPU alone: where the time goes (a diagnostic).

    PYTHONPATH=. python benchmarks/offload_step_cpu.py --numel 134217728 --chunk 16777216

Times, on an fp32 master with ``DeepSpeedCPUAdam``: ``plain`` (an fp32 gradient handed over, one step),
``chunked`` (a bf16 ``ChunkedGradShard`` stepped by ``step_in_chunks``, as offloaded ZeRO-3 does), and the
bf16->fp32 conversion of every chunk into a fresh tensor per chunk (``convert_fresh``) vs one reused buffer
(``convert_reused``); and one backward's folds into a bf16 shard whose chunks are allocated afresh
(``fill_fresh``, as each step did before [Note: kept host chunks]) vs kept from the previous step
(``fill_kept``); and one chunk converted and scaled in one go (``convert_scale_whole``) vs block by block
(``convert_scale_blocked``, ``convert_scaled``: what ``step_in_chunks`` does on the host); and the gradient norm
over the bf16 shard upcast into a fresh tensor per piece (``norm_fresh``) vs through one reused buffer (``norm_reused``,
``local_sq_norm``); and a step's reads of gradients parked in host-resident parameter shards (``offload_param``,
[Note: parked grads]): copied into a staging buffer and then converted (``parked_copy_convert``) vs converted
straight from the shards (``parked_convert_into``); and the overlapped host step's update with the rounded
copies published (into a host tensor here), stepped on the caller's thread as ``OverlappedHostStep.run`` does after
the global decision (``host_step_callers``) vs on the host worker with the caller only publishing
(``host_step_worker``, the route of an update started during the backward); and a chunked update with 16-bit
states (bf16 master and moments) in the host Adam's one pass (``bf16_states_one_pass``) vs converted, stepped and
copied out apart (``bf16_states_general``). Each figure is the median of ``--reps`` runs after one warm-up run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deepspeed._core.comm.pinned_pool import Pinning
from deepspeed._core.grads.accumulator import KEPT_CHUNKS, ChunkedGradShard
from deepspeed._core.grads.convert import convert_scaled
from deepspeed._core.grads.parked import Parked, ParkedWindow
from deepspeed._core.optim.chunked_step import ChunkStepper, step_in_chunks
from deepspeed._core.optim.clipping import NORM_CHUNK_NUMEL, local_sq_norm
from deepspeed._core.optim.host_step import GroupStep, OverlappedHostStep, pool_for_step
from deepspeed.ops.adam import DeepSpeedCPUAdam

Case = Callable[[], float]


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _shard(n: int, ch: int) -> ChunkedGradShard:
    """A bf16 gradient shard of ``n`` elements in chunks of ``ch``, filled with random values."""
    acc = ChunkedGradShard(n, ch, torch.bfloat16, "cpu")
    for s in range(0, n, ch):
        acc.add_(s, torch.randn(min(ch, n - s)).bfloat16())
    return acc


def step_cases(n: int, ch: int) -> dict[str, Case]:
    """A whole fp32 gradient handed to ``DeepSpeedCPUAdam`` against the chunked step over a bf16 shard."""
    master = torch.nn.Parameter(torch.randn(n), requires_grad=False)
    opt = DeepSpeedCPUAdam([master], lr=1e-3)

    def plain() -> float:
        g = torch.randn(n)
        t = time.perf_counter()
        g.mul_(0.5)
        master.grad = g
        opt.step()
        master.grad = None
        return time.perf_counter() - t

    def chunked() -> float:
        acc = _shard(n, ch)
        return _timed(lambda: step_in_chunks(opt, 0, acc, ch, 0.5, consume=True))

    return {"plain": plain, "chunked": chunked}


def convert_cases(n: int, ch: int) -> dict[str, Case]:
    """Conversions of the bf16 chunks to fp32: fresh tensors against one reused buffer; one chunk scaled in one
    pass against block by block; one backward's folds into fresh against kept chunks."""

    def convert(reuse: bool) -> float:
        acc, buf = _shard(n, ch), torch.empty(ch)
        t = time.perf_counter()
        for s in range(0, n, ch):
            w = acc.window(s, min(s + ch, n))
            x = buf[: w.numel()].copy_(w) if reuse else w.to(torch.float32, copy=True)
            x.mul_(0.5)
        return time.perf_counter() - t

    kept = ChunkedGradShard(n, ch, torch.bfloat16, "cpu", KEPT_CHUNKS)
    incoming, src, out = torch.randn(ch).bfloat16(), torch.randn(ch).bfloat16(), torch.empty(ch)

    def fill(shard: ChunkedGradShard) -> float:
        elapsed = _timed(lambda: [shard.add_(s, incoming[: min(ch, n - s)]) for s in range(0, n, ch)])
        shard.reset()
        return elapsed

    return {
        "convert_scale_whole": lambda: _timed(lambda: out.copy_(src).mul_(0.5)),
        "convert_scale_blocked": lambda: _timed(lambda: convert_scaled(out, src, 0.5)),
        "convert_fresh": lambda: convert(False),
        "convert_reused": lambda: convert(True),
        "fill_fresh": lambda: fill(ChunkedGradShard(n, ch, torch.bfloat16, "cpu")),
        "fill_kept": lambda: fill(kept),
    }


def norm_cases(n: int, ch: int) -> dict[str, Case]:
    """Sum of squares of the bf16 shard: ``local_sq_norm`` (one reused, cache-sized upcast buffer) against a
    fresh fp32 tensor per 8M-element piece."""
    chunks = _shard(n, ch).allocated()

    def fresh() -> None:
        total = torch.zeros(())
        for c in chunks:
            for start in range(0, c.numel(), NORM_CHUNK_NUMEL):
                piece = c[start : start + NORM_CHUNK_NUMEL].float()
                total += torch.dot(piece, piece)

    return {"norm_fresh": lambda: _timed(fresh), "norm_reused": lambda: _timed(lambda: local_sq_norm(chunks))}


def parked_cases(n: int, ch: int) -> dict[str, Case]:
    """A step's reads of gradients parked in host-resident parameter shards: staged then converted, against
    converted straight from the shards."""
    region_numel = 4 << 20  # about one 3B-model matrix per region
    regions = [
        Parked(SimpleNamespace(shard=torch.randn(min(region_numel, n - o)).bfloat16(), ds_id=o), 0, o)
        for o in range(0, n, region_numel)
    ]
    empty_acc = ChunkedGradShard(n, ch, torch.bfloat16, "cpu")
    staging = [torch.empty(ch, dtype=torch.bfloat16) for _ in range(2)]
    out = torch.empty(ch)

    def parked(direct: bool) -> float:
        window = ParkedWindow(empty_acc, regions, staging, ch, n)
        t = time.perf_counter()
        for s in range(0, n, ch):
            e = min(s + ch, n)
            if direct:
                window.convert_into(s, e, out[: e - s], 0.5)
            else:
                convert_scaled(out[: e - s], window.window(s, e), 0.5)
        return time.perf_counter() - t

    return {"parked_copy_convert": lambda: parked(False), "parked_convert_into": lambda: parked(True)}


def host_step_cases(n: int, ch: int) -> dict[str, Case]:
    """One update of an fp32 master with a bf16 gradient, each stepped chunk's bf16 copy published into a host
    tensor: stepped on the caller's thread against on the host worker."""
    master = torch.nn.Parameter(torch.randn(n), requires_grad=False)
    opt = DeepSpeedCPUAdam([master], lr=1e-3)
    grad, weights = torch.randn(n).bfloat16(), torch.empty(n, dtype=torch.bfloat16)
    host = OverlappedHostStep(pool_for_step(ch, Pinning.PAGEABLE))

    def publish(start: int, piece: torch.Tensor) -> None:
        weights[start : start + piece.numel()].copy_(piece)

    def update(on_worker: bool) -> float:
        group = GroupStep(ChunkStepper(opt, 0, ch), grad, publish, torch.bfloat16)
        t = time.perf_counter()
        if on_worker:
            run = host.begin([group], 0.5, rounded_by_worker=True)
            run.submit_rest()
            run.publish()
        else:
            host.run([group], 0.5)
        return time.perf_counter() - t

    return {"host_step_callers": lambda: update(False), "host_step_worker": lambda: update(True)}


class _GeneralRouteAdam(DeepSpeedCPUAdam):
    """The host Adam without its one-pass form: every range is converted, stepped and copied out apart."""

    step_scaled = None


def bf16_state_cases(n: int, ch: int) -> dict[str, Case]:
    """One chunked update of a bf16 master with bf16 moments (16-bit offloaded states), a bf16 gradient scaled by
    0.5 and each chunk's copy written out: in the kernel's one pass against the general route."""
    start, grad = torch.randn(n).bfloat16(), torch.randn(n).bfloat16()
    copy = torch.empty(n, dtype=torch.bfloat16)

    def update(optimizer_class: type) -> Case:
        master = torch.nn.Parameter(start.clone(), requires_grad=False)
        opt = optimizer_class([master], lr=1e-3, fp32_optimizer_states=False)

        def run() -> float:
            stepper = ChunkStepper(opt, 0, ch)
            t = time.perf_counter()
            for lo, hi in stepper.ranges():
                stepper.step_range(lo, hi, grad, 0.5, copy_out=copy[lo:hi])
            stepper.close()
            return time.perf_counter() - t

        return run

    return {"bf16_states_one_pass": update(DeepSpeedCPUAdam), "bf16_states_general": update(_GeneralRouteAdam)}


def main() -> None:
    """Time every case (see the module docstring) and print one JSON line."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=128 << 20)
    ap.add_argument("--chunk", type=int, default=16 << 20)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    n, ch = args.numel, args.chunk
    torch.manual_seed(0)
    cases = {
        **parked_cases(n, ch),
        **step_cases(n, ch),
        **norm_cases(n, ch),
        **convert_cases(n, ch),
        **host_step_cases(n, ch),
        **bf16_state_cases(n, ch),
    }
    out = {"numel": n, "chunk": ch, "threads": torch.get_num_threads(), "torch": torch.__version__}
    for name, fn in cases.items():
        fn()
        out[name + "_s"] = round(statistics.median(fn() for _ in range(args.reps)), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
