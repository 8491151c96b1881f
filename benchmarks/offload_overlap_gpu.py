"""Offloaded optimizer step on one GPU: overlapped vs synchronous host step, beside the floor of its parts.

    PYTHONPATH=. python benchmarks/offload_overlap_gpu.py --layers 36 --seq 8192 --steps 6 --out OUT.jsonl

Builds the Qwen2-shaped decoder of ``benchmarks/models.py`` (random weights, bf16, hidden 2048, 16 heads,
2 key/value heads, intermediate 11008, vocabulary 151936, tied embeddings: 3.09 B parameters at 36 layers;
``--layers`` scales it between about 1 and 3 B), with activation checkpointing, and measures, each as the median of
``--steps`` timed steps after two warm-up steps:

- ``overlap_on`` / ``overlap_off``: the engine's step time (forward, backward, ``engine.step()``) with
  ``offload_optimizer: cpu`` and ``zero_optimization.lean_overlap_offload_step`` true / false (same config
  otherwise; ``--stage``);
- the floor's parts, measured on the same machine: ``fwd_bwd`` (the model's forward and backward on the GPU
  alone, plain PyTorch), ``host_adam`` (the host optimizer over this many parameters alone: ``step_in_chunks``
  of ``DeepSpeedCPUAdam`` over an fp32 master with a bf16 gradient, as the engine steps it), ``d2h`` / ``h2d``
  (the bf16 gradients down and the bf16 weights up through two pinned buffers of one step chunk);
  ``floor`` = max(fwd_bwd, host_adam, d2h + h2d); ``host_adam_as_engine`` (not in the floor) is ``host_adam`` run
  as the engine runs it, from a worker thread with each chunk's rounded copy written to pinned staging;
  ``floor_after_norm`` = fwd_bwd + host_adam, the bound when the update must wait
  for the global gradient norm (clipping, as configured here);
- ``zenflow`` / ``gpu_resident`` (ZeRO-2 whatever ``--stage`` says): the one-step-delayed update
  (``zero_optimization.zenflow``, 10 % of the columns every step, the rest every 4 steps, the host update
  overlapping the next step) against the same model with its optimizer on the GPU;
- ``overlap_on_long_route``: ``overlap_on`` with the host Adam's scaled step turned off (each chunk's gradient
  converted to fp32 and scaled in passes of its own, the copy up rounded from the master afterwards), for the
  same-call ratio of that one-pass form;
- ``overlap_on_noclip``: ``overlap_on`` with ``gradient_clipping`` 0 and ``bf16.check_grad_overflow`` false: no
  global decision, so the update of each step chunk whose gradients are final starts during the backward (at
  ZeRO-3 from the second step on, once each parameter's gradient arrivals are recorded); the engine's count of
  chunks so started is recorded as ``early_chunks``;
- ``overlap_on_long_switch`` / ``overlap_on_noclip_long_switch``: those two with
  ``zero_optimization.lean_short_switch_interval`` false (the interpreter's switch interval left at 5 ms while the
  host worker steps), for the same-call ratio of the short interval;
- ``bf16_states``: the overlapped step with 16-bit master weights and optimizer states on the host; ``nvme``: the
  overlapped step with the optimizer states swapped to files under ``--nvme-path`` (ZeRO-3), the swap keys at
  their defaults (no pipelining, one I/O worker); ``nvme_pipelined``: the same with the swaps pipelined
  (``pipeline_read``/``pipeline_write``, 4 buffer sets) and 2 I/O workers of queue depth 8 (``aio``).

With ``--breakdown`` each engine case also records where the host time of its step goes: wall seconds per thread
in the optimizer's phases (gradient flush, norm, each chunk's gradient fetch, the inner optimizer, the
write-back's conversion and copies), summed over the timed steps, and one profiled step's operator tables, the
last grouped by the Python lines that issued each operator (``--breakdown-dir``).

Engine cases also record host bytes per parameter (the optimizer's own count and the process's resident set) and
the disk bytes read and written per step (the process's I/O counters). ``--cases`` picks what runs.

Each line of the output is one JSON record: ``{"case": ..., "seconds": ..., "params": ..., ...}``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# case -> (overlapped host step, 16-bit offloaded states, optimizer states on NVMe)
ENGINE_CASES = {
    "overlap_on": (True, False, False),
    "overlap_off": (False, False, False),
    "overlap_on_long_route": (True, False, False),
    "overlap_on_noclip": (True, False, False),
    "overlap_on_long_switch": (True, False, False),
    "overlap_on_noclip_long_switch": (True, False, False),
    "bf16_states": (True, True, False),
    "nvme": (True, False, True),
    "nvme_pipelined": (True, False, True),
    "zenflow": (True, False, False),
    "gpu_resident": (False, False, False),
}


def _model(layers: int, device: str) -> torch.nn.Module:
    # The benchmarks' own Qwen2-shaped decoder (benchmarks/models.py: no transformers needed on the GPU machine),
    # with activation checkpointing inside every decoder layer.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import dataclasses

    from models import MODELS, build_model

    MODELS["overlap"] = dataclasses.replace(MODELS["qwen2-3b"], layers=layers)
    return build_model("overlap", torch.device(device), torch.bfloat16)


def _batch(seq: int, device: str) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151936, (1, seq + 1), generator=g)
    return {"ids": ids[:, :-1].contiguous().to(device), "labels": ids[:, 1:].contiguous().to(device)}


def _median(run: Callable[[], None], steps: int, warmup: int = 2) -> float:
    times = []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for i in range(warmup + steps):
        sync()
        start = time.perf_counter()
        run()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


# (module, owner attribute path, method): the optimizer's phases that --breakdown times.
PHASES = [
    ("deepspeed._core.optim.stage3", "Stage3Optimizer", "flush"),
    ("deepspeed._core.optim.stage3", "Stage3Optimizer", "_decide_step"),
    ("deepspeed._core.optim.stage3", "Stage3Optimizer", "_update"),
    ("deepspeed._core.optim.stage3", "Stage3Optimizer", "write_back"),
    ("deepspeed._core.optim.stage3", "Stage3Optimizer", "_clear_grads"),
    ("deepspeed._core.optim.stage3", None, "local_sq_norm"),
    ("deepspeed._core.optim.chunked_step", "ChunkStepper", "_grad_of"),
    ("deepspeed._core.optim.chunked_step", "ChunkStepper", "step_range"),
    ("deepspeed._core.optim.chunked_step", None, "convert_scaled"),
    ("deepspeed._core.optim.chunked_step", None, "_merge_back"),
    ("deepspeed._core.optim.host_step", "StepRun", "publish"),
    ("deepspeed._core.optim.host_step", "StepRun", "_step"),
    ("deepspeed._core.grads.parked", "ParkedWindow", "_staged"),
    ("deepspeed._core.grads.parked", "ParkedWindow", "_fill"),
    ("deepspeed.ops.adam.cpu_adam", "DeepSpeedCPUAdam", "step"),
]


class _Spans:
    """Wall time per (thread, phase) of the wrapped methods; nested phases each count their whole span."""

    def __init__(self) -> None:
        import threading

        self.threading = threading
        self.spans: list[tuple[str, str, float, float]] = []
        self.undo: list[tuple[object, str, object]] = []

    def wrap_all(self) -> None:
        import importlib

        for module_name, owner_name, attr in PHASES:
            module = importlib.import_module(module_name)
            owner = getattr(module, owner_name) if owner_name else module
            original = vars(owner).get(attr)  # None: inherited, so the wrapper is removed again afterwards
            self.undo.append((owner, attr, original))
            setattr(owner, attr, self._timed(getattr(owner, attr), attr))

    def _timed(self, original: Callable, label: str) -> Callable:
        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                name = self.threading.current_thread().name.split("_")[0]
                self.spans.append((name, label, start, time.perf_counter()))

        return timed

    def unwrap(self) -> None:
        for owner, attr, original in reversed(self.undo):
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self.undo.clear()

    def sums(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for thread, label, start, end in self.spans:
            key = f"{thread}:{label}"
            out[key] = out.get(key, 0.0) + end - start
        return {k: round(v, 4) for k, v in sorted(out.items())}


def _timed_phases(step_parts: Callable[[], list[float]], steps: int, spans: _Spans) -> dict:
    """Run warm-up and timed steps; per timed step the synchronised forward/backward/step seconds."""
    for _ in range(2):
        step_parts()
    spans.spans.clear()
    rows = [step_parts() for _ in range(steps)]
    return {
        "fwd_s": statistics.median(r[0] for r in rows),
        "bwd_s": statistics.median(r[1] for r in rows),
        "step_s": statistics.median(r[2] for r in rows),
        "phase_seconds_per_step": {k: round(v / steps, 4) for k, v in spans.sums().items()},
    }


def _profile_one(run: Callable[[], object], path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    # Python stacks reach key_averages() only with the verbose experimental config (with_stack alone records none).
    stacks = torch._C._profiler._ExperimentalConfig(verbose=True)
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True, experimental_config=stacks
    ) as prof:
        run()
        torch.cuda.synchronize()
    table = prof.key_averages()
    by_site = prof.key_averages(group_by_stack_n=5)  # which Python lines issue the host operators
    path.write_text(
        table.table(sort_by="self_cpu_time_total", row_limit=40)
        + "\n\n"
        + table.table(sort_by="self_device_time_total", row_limit=25)
        + "\n\n"
        + by_site.table(sort_by="self_cpu_time_total", row_limit=30)
    )
    prof.export_chrome_trace(str(path.with_suffix(".trace.json")))


def _engine_case(args: argparse.Namespace, label: str, overlap: bool, bf16_states: bool, nvme: str | None) -> dict:
    import psutil

    import deepspeed

    noclip = "_noclip" in label
    bf16 = {"enabled": True, **({"check_grad_overflow": False} if noclip else {})}
    if bf16_states:
        bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    offload = {"device": "nvme", "nvme_path": nvme} if nvme else {"device": "cpu"}
    if label == "nvme_pipelined":  # the swap pipelined, several requests in flight
        offload.update(pipeline_read=True, pipeline_write=True, buffer_count=4)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0 if noclip else 1.0,
        "bf16": bf16,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": args.stage,
            "offload_optimizer": {**offload, "pin_memory": True},
            "lean_overlap_offload_step": overlap,
            "lean_short_switch_interval": not label.endswith("_long_switch"),
        },
    }
    if label == "nvme_pipelined":
        cfg["aio"] = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 2, "overlap_events": True}
    zero = cfg["zero_optimization"]
    if label in ("zenflow", "gpu_resident"):  # the delayed update and what it is held against: ZeRO-2
        zero["stage"] = 2
    if label == "zenflow":
        zero["zenflow"] = {"topk_ratio": 0.1, "update_interval": 4, "select_interval": "auto", "overlap_step": True}
    if label == "gpu_resident":
        del zero["offload_optimizer"]
    model = _model(args.layers, "cuda")
    params = sum(p.numel() for p in model.parameters())
    client = None
    if label.endswith("_long_route"):
        # The same host Adam without its one-pass form, given as a client optimizer (the config's "AdamW" would
        # build the one-pass DeepSpeedCPUAdam).
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        class LongRouteAdam(DeepSpeedCPUAdam):
            step_scaled = None  # the chunk stepper then converts, scales and rounds in passes of their own

        opt_params = cfg.pop("optimizer")["params"]
        cfg.update(zero_allow_untested_optimizer=True, zero_force_ds_cpu_optimizer=False)

        def client(params: list) -> DeepSpeedCPUAdam:
            return LongRouteAdam(params, **opt_params)

    engine, *_ = deepspeed.initialize(model=model, optimizer=client, config=cfg)
    batch = _batch(args.seq, "cuda")

    def step() -> None:
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()

    breakdown: dict = {}
    if args.breakdown:
        breakdown = _breakdown(args, engine, batch, label)
    io_before = psutil.Process().io_counters()
    seconds = _median(step, args.steps)
    io_after = psutil.Process().io_counters()
    steps = args.steps + 2  # the warm-up steps move the same bytes
    out = {
        **breakdown,
        "seconds": seconds,
        "host_bytes_per_param": engine.optimizer.host_state_bytes() / params,
        "host_rss_bytes_per_param": psutil.Process().memory_info().rss / params,
        "disk_read_gib_per_step": (io_after.read_bytes - io_before.read_bytes) / steps / 2**30,
        "disk_written_gib_per_step": (io_after.write_bytes - io_before.write_bytes) / steps / 2**30,
        "early_chunks": getattr(engine.optimizer, "early_chunks", 0),
    }
    engine.destroy()
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _breakdown(args: argparse.Namespace, engine: object, batch: dict, label: str) -> dict:
    """Forward, backward and step each timed apart (synchronised), with the optimizer's phases per thread."""

    def parts() -> list[float]:
        marks = [time.perf_counter()]
        loss = engine(**batch)
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
        engine.backward(loss)
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
        engine.step()
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
        return [b - a for a, b in itertools.pairwise(marks)]

    spans = _Spans()
    spans.wrap_all()
    try:
        out = _timed_phases(parts, args.steps, spans)
    finally:
        spans.unwrap()
    if args.breakdown_dir is not None:
        args.breakdown_dir.mkdir(parents=True, exist_ok=True)
        _profile_one(parts, args.breakdown_dir / f"profile_{label}.txt")
    return out


def _fwd_bwd(args: argparse.Namespace) -> tuple[float, int]:
    model = _model(args.layers, "cuda")
    params = sum(p.numel() for p in model.parameters())
    batch = _batch(args.seq, "cuda")

    def run() -> None:
        model(**batch).backward()
        for p in model.parameters():
            p.grad = None

    seconds = _median(run, args.steps)
    gc.collect()
    torch.cuda.empty_cache()
    return seconds, params


def _host_adam(params: int, steps: int, worker: bool = False, copy_to: str = "", pinned_state: bool = False) -> float:
    """The host optimizer alone, stepped chunk by chunk as the engine steps it. ``worker``: from one worker thread
    kept across updates;
    ``copy_to`` (``"pinned"`` / ``"pageable"``): each chunk's rounded bf16 copy written into one of two staging
    buffers of that kind in the step's own pass; ``pinned_state``: master and gradient in page-locked memory."""
    from deepspeed._core.optim.chunked_step import ChunkStepper, step_chunk_numel
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    master = torch.nn.Parameter(torch.zeros(params, dtype=torch.float32, pin_memory=pinned_state), requires_grad=False)
    grad = torch.full((params,), 1e-3, dtype=torch.bfloat16, pin_memory=pinned_state)
    opt = DeepSpeedCPUAdam([master], lr=1e-5)
    chunk = step_chunk_numel(torch.float32, 0)
    staging = [
        torch.empty(chunk, dtype=torch.bfloat16, pin_memory=copy_to == "pinned") for _ in range(2 * bool(copy_to))
    ]

    def stepped() -> None:
        stepper = ChunkStepper(opt, 0, chunk)
        try:
            for i, (start, end) in enumerate(stepper.ranges()):
                out = staging[i % 2][: end - start] if staging else None
                stepper.step_range(start, end, grad, 1.0, copy_out=out)
        finally:
            stepper.close()

    # One worker thread for every update, as the engine keeps one: its thread pool is set up once, in the warm-up.
    pool = ThreadPoolExecutor(max_workers=1) if worker else None

    def run() -> None:
        if pool is None:
            stepped()
            return
        pool.submit(stepped).result()

    seconds = _median(run, steps, warmup=1)
    if pool is not None:
        pool.shutdown()
    gc.collect()
    return seconds


HOST_ADAM_VARIANTS = {
    "host_adam_worker": {"worker": True},
    "host_adam_copy_pinned": {"copy_to": "pinned"},
    "host_adam_copy_pageable": {"copy_to": "pageable"},
    "host_adam_worker_copy_pageable": {"worker": True, "copy_to": "pageable"},
    "host_adam_as_engine": {"worker": True, "copy_to": "pinned"},
    "host_adam_pinned_state": {"pinned_state": True},
}
"""``--cases host_adam_variants``: the host update alone in each way the engine's differs from the floor's."""


def _copies(params: int, steps: int) -> tuple[float, float]:
    """Seconds to move ``params`` bf16 elements down and up through two pinned chunk buffers."""
    chunk = 1 << 25
    device = torch.empty(params, dtype=torch.bfloat16, device="cuda")
    host = torch.empty(params, dtype=torch.bfloat16)
    pinned = [torch.empty(chunk, dtype=torch.bfloat16, pin_memory=True) for _ in range(2)]

    def transfer(down: bool) -> None:
        events: list = [None, None]
        landed: list = [None, None]  # (start, n) a slot's copy down holds, folded into ``host`` once it is done

        def settle(slot: int) -> None:
            if events[slot] is not None:
                events[slot].synchronize()
                if down and landed[slot] is not None:
                    start, n = landed[slot]
                    host[start : start + n].copy_(pinned[slot][:n])
            events[slot] = landed[slot] = None

        for i, start in enumerate(range(0, params, chunk)):
            slot, n = i % 2, min(chunk, params - start)
            settle(slot)
            if down:
                pinned[slot][:n].copy_(device[start : start + n], non_blocking=True)
                landed[slot] = (start, n)
            else:
                pinned[slot][:n].copy_(host[start : start + n])
                device[start : start + n].copy_(pinned[slot][:n], non_blocking=True)
            events[slot] = torch.cuda.Event()
            events[slot].record()
        settle(0)
        settle(1)

    d2h = _median(lambda: transfer(True), steps, warmup=1)
    h2d = _median(lambda: transfer(False), steps, warmup=1)
    return d2h, h2d


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--stage", type=int, default=3, choices=[1, 2, 3])
    parser.add_argument("--cases", default="overlap_on,overlap_off,bf16_states,floor", help=", ".join(ENGINE_CASES))
    parser.add_argument("--variant-params", type=int, default=1_000_000_000, help="host_adam_variants' size")
    parser.add_argument("--nvme-path", default="/tmp/nvme_swap", help="swap folder of the nvme case")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--breakdown", action="store_true", help="time the step's phases per thread")
    parser.add_argument("--breakdown-dir", type=Path, default=None, help="profiled step's tables and trace")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("offload_overlap_gpu.py needs a CUDA device")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29513")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    import deepspeed

    deepspeed.init_distributed("nccl")
    meta = {"layers": args.layers, "seq": args.seq, "stage": args.stage, "device": torch.cuda.get_device_name()}
    cases = args.cases.split(",")
    records = []
    if cases == ["host_adam_variants"]:  # the host update alone, at --variant-params parameters
        runs = max(2, args.steps // 2)
        records = [{"case": "host_adam", "seconds": _host_adam(args.variant_params, runs)}]
        records += [
            {"case": k, "seconds": _host_adam(args.variant_params, runs, **v)} for k, v in HOST_ADAM_VARIANTS.items()
        ]
        _emit(args, meta, args.variant_params, records)
        return
    fwd_bwd, params = _fwd_bwd(args)
    records.append({"case": "fwd_bwd", "seconds": fwd_bwd})
    for case in (c for c in cases if c in ENGINE_CASES):
        overlap, bf16_states, nvme = ENGINE_CASES[case]
        if nvme:
            Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
        swap = args.nvme_path if nvme else None
        records.append({"case": case, **_engine_case(args, case, overlap, bf16_states, swap)})
    if "floor" in cases:
        host_adam = _host_adam(params, max(2, args.steps // 2))
        records.append({"case": "host_adam", "seconds": host_adam})
        # Not part of the floor: the same update as the engine runs it, to tell its own cost from the rest.
        as_engine = _host_adam(params, max(2, args.steps // 2), **HOST_ADAM_VARIANTS["host_adam_as_engine"])
        records.append({"case": "host_adam_as_engine", "seconds": as_engine})
        d2h, h2d = _copies(params, args.steps)
        records += [{"case": "d2h", "seconds": d2h}, {"case": "h2d", "seconds": h2d}]
        records.append({"case": "floor", "seconds": max(fwd_bwd, host_adam, d2h + h2d)})
        # With clipping (the engine cases here), no chunk may change before the backward's global norm is known:
        # the update cannot overlap this step's forward and backward, whatever the implementation.
        records.append({"case": "floor_after_norm", "seconds": fwd_bwd + host_adam})
    _emit(args, meta, params, records)


def _emit(args: argparse.Namespace, meta: dict, params: int, records: list[dict]) -> None:
    lines = [json.dumps({**meta, "params": params, **r}) for r in records]
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
