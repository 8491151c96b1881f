"""Cost of the monitors and the FLOPs profiler: step time with them on against off, in one process.

    PYTHONPATH=. python benchmarks/monitor_overhead.py                        # gpt1.3b at seq 1024, bf16, one GPU
    PYTHONPATH=. python benchmarks/monitor_overhead.py --model quick --steps 10 --dtype fp32   # CPU smoke run
    PYTHONPATH=. python benchmarks/monitor_overhead.py --device cpu --model quick --dtype fp32 --stage 0 \
        --micro-batch 1 --threads 1 --steps 400 --window 20 --out cpu.json   # host time the monitors add, on CPU

Two engines train the same model from the same weights in one process, one rank (a real one-process group):
``off`` with no monitor, ``on`` with the ``tensorboard`` and ``csv_monitor`` monitors (every scalar the engine
writes: lr, loss, per-phase memory, samples and tokens per second) and the ``flops_profiler`` (profiling the step
after ``--profile-step``, report written to a file). The two run in alternating windows of ``--window`` optimizer
steps, so drift of the machine (clocks, other jobs) falls on both alike. Step time is wall-clock between optimizer
steps with the device synchronised at the window edges only. Printed and written as one JSON record: the median
step time of each engine over its windows, the overhead ``on / off - 1`` of the medians, and the profiled step
alone (a one-off cost, reported separately because it happens once per run). The ``flops_profiler`` block turns
``wall_clock_breakdown`` on in ``on`` (upstream's rule), so its phase timers and their printed lines are part of the
cost measured. ``added_ms_per_step`` is the difference of the medians: on a CPU run with a tiny model it is the host
time the monitors and timers add to a step (``--device cpu`` selects the CPU accelerator even where a GPU exists).
``added_cpu_ms_per_step`` compares the process CPU time per step (every thread, the monitors' writer included); with
``--threads 1`` on a busy shared host it is the steadier of the two figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1 :][:1] == ["cpu"]:
    os.environ["DS_ACCELERATOR"] = "cpu"  # before deepspeed picks its accelerator
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29913")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")

import torch

from models import MODELS, build_model, random_batch, with_seq

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _config(args: argparse.Namespace, out: Path | None) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.gas,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": args.stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    }
    if args.dtype in ("bf16", "fp16"):
        cfg[args.dtype] = {"enabled": True}
    if out is not None:
        cfg["tensorboard"] = {"enabled": True, "output_path": str(out), "job_name": "tb"}
        cfg["csv_monitor"] = {"enabled": True, "output_path": str(out), "job_name": "csv"}
        cfg["flops_profiler"] = {
            "enabled": True,
            "profile_step": args.profile_step,
            "output_file": str(out / "flops.txt"),
            "detailed": False,
        }
        cfg["wall_clock_breakdown"] = False
    return cfg


def _engine(args: argparse.Namespace, device: torch.device, out: Path | None):
    import deepspeed

    model = build_model(args.model_key, device, torch.float32)
    engine, *_ = deepspeed.initialize(model=model, config=_config(args, out))
    return engine


def _steps(engine, batches, n: int, sync) -> list[tuple[float, float]]:
    """(wall, process CPU) seconds of ``n`` optimizer steps, the device synchronised before the first and after the
    last. The CPU time counts every thread of the process (the monitors' writer thread too)."""
    sync()
    times = []
    for _ in range(n):
        start, cpu = time.perf_counter(), time.process_time()
        for ids, labels in batches:
            engine.backward(engine(ids, labels))
            engine.step()
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    sync()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt1.3b", choices=sorted(MODELS))
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--gas", type=int, default=1)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per engine, after warm-up")
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile-step", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the JSON record here too")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu"], help="cpu: the CPU accelerator")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (1: CPU time is host time)")
    args = parser.parse_args()
    args.model_key = with_seq(args.model, None if args.model.startswith("quick") else args.seq)

    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    acc = get_accelerator()
    dist.init_distributed(dist_backend=acc.communication_backend_name())
    device = torch.device(acc.device_name(acc.current_device()))
    cfg = MODELS[args.model_key]
    batches = [random_batch(cfg, args.micro_batch, device, seed=i) for i in range(args.gas)]
    work = Path(tempfile.mkdtemp(prefix="monitor_overhead_"))
    engines = {"off": _engine(args, device, None), "on": _engine(args, device, work)}
    sync = acc.synchronize
    for engine in engines.values():
        _steps(engine, batches, args.warmup, sync)

    times: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    profiled_step: tuple[float, float] | None = None
    while len(times["off"]) < args.steps:
        for name, engine in engines.items():
            before = engine.global_steps
            window = _steps(engine, batches, args.window, sync)
            profiled_at = args.profile_step - before  # index of the profiled step within this window, if any
            if name == "on" and 0 <= profiled_at < len(window):
                profiled_step = window.pop(profiled_at)
            times[name].extend(window)

    med = {name: statistics.median(t for t, _ in ts) for name, ts in times.items()}
    cpu = {name: statistics.median(c for _, c in ts) for name, ts in times.items()}
    record = {
        "benchmark": "monitor_overhead",
        "device": acc.device_name() if device.type == "cpu" else torch.cuda.get_device_name(device),
        "model": args.model_key,
        "dtype": args.dtype,
        "zero_stage": args.stage,
        "micro_batch": args.micro_batch,
        "gas": args.gas,
        "steps_per_engine": {name: len(ts) for name, ts in times.items()},
        "median_step_s": med,
        "min_step_s": {name: min(t for t, _ in ts) for name, ts in times.items()},
        "overhead_pct": 100.0 * (med["on"] / med["off"] - 1.0),
        "added_ms_per_step": 1000.0 * (med["on"] - med["off"]),
        "median_cpu_step_s": cpu,
        "added_cpu_ms_per_step": 1000.0 * (cpu["on"] - cpu["off"]),
        "torch_threads": torch.get_num_threads(),
        "profiled_step_s": None if profiled_step is None else profiled_step[0],
        "profile_written": (work / "flops.txt").exists(),
        "scalars_written": sorted(p.name for p in (work / "csv").glob("*.csv")),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["python", *sys.argv]),
    }
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    for engine in engines.values():
        engine.destroy()


if __name__ == "__main__":
    main()
