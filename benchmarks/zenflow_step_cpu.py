"""ZenFlow's host side on the CPU alone: one step of each kind over a Qwen2-shaped layer stack's partition.

    PYTHONPATH=. python benchmarks/zenflow_step_cpu.py --layers 2 --reps 3

Builds the ZeRO-1/2 ZenFlow update ([Note: zenflow]) over one fp32 master of ``--layers`` decoder layers of the
3B benchmark model's widths (hidden 2048, MLP 11008, 16 heads of 128, 2 kv heads) with ``DeepSpeedCPUAdam``, as
the engine builds it at world size 1, and times (median of ``--reps`` after one warm-up): ``every_step`` (the
selected columns stepped on the host, the rest accumulated: what each step costs the host), ``every_step_columns``
(the same with the selected columns kept as device columns, [Note: zenflow columns], here on the CPU too), its
parts ``columns_pack_grad`` and ``columns_accumulate`` (what stays on the host once an accelerator holds the
columns) and ``columns_adam`` (the packed Adam step the accelerator takes over), ``every_step_columns_returns``
(what ``step()`` alone holds the training thread for: the addition into the accumulators runs on the worker
after it returns), ``host_update`` and ``host_update_columns`` (the late path's update over the accumulated rest,
run synchronously, with the every-step path on the host and as device columns),
``background_packed`` / ``settle_packed`` and ``background_in_place`` / ``settle_in_place`` (the same update with
``overlap_step``: what the worker spends on it, and what applying it at the next step boundary holds the training
thread for, with the every-step path on the host and with device columns, [Note: zenflow in-place host update])
and ``plain_step`` (the same optimizer over the whole master, what the offloaded step without ZenFlow costs). Prints
one JSON line per figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable

import torch

from deepspeed._core.config.plan import ZenFlowPolicy
from deepspeed._core.optim.zenflow import ZenFlowUpdate
from deepspeed.ops.adam import DeepSpeedCPUAdam

HIDDEN, MLP, KV = 2048, 11008, 256
LAYER = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP)]
NORMS = [(HIDDEN,), (HIDDEN,), (KV,), (KV,), (HIDDEN,)]  # two norms, the k/v and q biases


def _layout(layers: int) -> list[tuple[int, tuple[int, ...]]]:
    params, offset = [], 0
    for _ in range(layers):
        for shape in LAYER + NORMS:
            params.append((offset, shape))
            offset += int(torch.Size(shape).numel())
    return params


def _median(run: Callable[[], None], reps: int) -> float:
    run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _stepped(update: ZenFlowUpdate, grad: torch.Tensor) -> None:
    """One step and the accumulation it leaves to the worker: the host work one step costs."""
    update.step([grad], 1.0)
    update.finish_accumulating()


def _host_update(update: ZenFlowUpdate) -> None:
    """The synchronous host update over one accumulated step (the accumulator's sums as they stand)."""
    update.accumulated = 1
    update._host_update()


def _overlapped(update: ZenFlowUpdate, grad: torch.Tensor, reps: int) -> tuple[float, float]:
    """Median seconds the worker spends on one background host update, and the median of its settling."""
    worker, settle = [], []
    for _ in range(reps + 1):
        _stepped(update, grad)  # one more step accumulated
        update._host_update()
        update.start_host_update()
        assert update.pending is not None
        begin = time.perf_counter()
        update.pending.job.result()
        worker.append(time.perf_counter() - begin)
        begin = time.perf_counter()
        update.settle()
        settle.append(time.perf_counter() - begin)
    return statistics.median(worker[1:]), statistics.median(settle[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--topk-ratio", type=float, default=0.1)
    args = parser.parse_args()
    params = _layout(args.layers)
    numel = params[-1][0] + int(torch.Size(params[-1][1]).numel())
    policy = ZenFlowPolicy(
        topk_ratio=args.topk_ratio, select_strategy="step", select_interval=1000, update_interval=1000
    )
    grad = torch.randn(numel, dtype=torch.bfloat16) * 1e-3
    start = torch.randn(numel) * 0.02

    def built(device: torch.device | None, overlap: bool = False) -> ZenFlowUpdate:
        """A ZenFlow update over a master and optimizer of its own, past the warm-up and its first selection."""
        master = torch.nn.Parameter(start.clone(), requires_grad=False)
        used = dataclasses.replace(policy, overlap_step=overlap, full_warm_up_rounds=1)
        update = ZenFlowUpdate(DeepSpeedCPUAdam([master], lr=1e-5), used, [(0, numel, params)], None, device)
        for _ in range(used.full_warm_up_rounds + 1):
            update.step([grad], 1.0)
        return update

    update = built(None)
    meta = {"numel": numel, "threads": torch.get_num_threads(), "topk_ratio": args.topk_ratio}
    rows = [("every_step", lambda: _stepped(update, grad)), ("host_update", lambda: _host_update(update))]
    for name, run in rows:
        print(json.dumps({**meta, "case": name, "seconds": _median(run, args.reps)}))
    update.shutdown()
    columns = built(torch.device("cpu"))
    packed = torch.randn(columns.columns[0].master.numel())
    group = columns.optimizer.param_groups[0]
    rows = [
        ("every_step_columns", lambda: _stepped(columns, grad)),
        ("columns_pack_grad", lambda: columns._selected_grad(0, grad, 1.0)),
        ("columns_accumulate", lambda: columns._add_to_accumulators([grad], 1.0)),
        ("columns_adam", lambda: columns.columns[0].step_(packed, group, columns.rule)),
        ("host_update_columns", lambda: _host_update(columns)),
    ]
    for name, run in rows:
        print(json.dumps({**meta, "case": name, "seconds": _median(run, args.reps)}))
    # What step() itself holds the training thread for, the addition into the accumulators left to the worker
    # ([Note: zenflow deferred accumulation]); each timed call starts with the worker idle.
    times = []
    for _ in range(args.reps + 1):
        columns.finish_accumulating()
        begin = time.perf_counter()
        columns.step([grad], 1.0)
        times.append(time.perf_counter() - begin)
    print(json.dumps({**meta, "case": "every_step_columns_returns", "seconds": statistics.median(times[1:])}))
    columns.shutdown()
    for route, device in (("packed", None), ("in_place", torch.device("cpu"))):
        update = built(device, overlap=True)
        worker, settle = _overlapped(update, grad, args.reps)
        assert (update.in_place_updates > 0) == (route == "in_place")
        update.shutdown()
        print(json.dumps({**meta, "case": f"background_{route}", "seconds": worker}))
        print(json.dumps({**meta, "case": f"settle_{route}", "seconds": settle}))
    master = torch.nn.Parameter(start.clone(), requires_grad=False)
    optimizer = DeepSpeedCPUAdam([master], lr=1e-5)

    def plain() -> None:
        master.grad = grad.float()
        optimizer.step()
        master.grad = None

    print(json.dumps({**meta, "case": "plain_step", "seconds": _median(plain, args.reps)}))


if __name__ == "__main__":
    main()
