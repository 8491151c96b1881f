"""Every initialisation path: device memory while ``deepspeed.initialize`` places a model built outside it.

One worker process per (implementation, configuration), so the caching-allocator counters of one never mix
with another's. A worker builds the model (on the host in fp32 unless the configuration says otherwise), resets
the peak counters, runs ``deepspeed.initialize`` and records the device peak during it, allocated and reserved
right after, and the model's bytes in the working dtype; then one training step.

Configurations (``CONFIGS``):
* ``host_offload_s3`` / ``host_offload_s3_fp32``: a user's set-up as its script is written: a Qwen2-shaped
  3.1B decoder built outside ``zero.Init`` (on the host, fp32), ZeRO-3 with the optimizer offloaded to pinned host
  memory, bf16 or fp32. The client optimizer is torch's AdamW (``zero_force_ds_cpu_optimizer`` false) so that no
  op has to be compiled; where the optimizer state lives, not its class, decides the device memory here.
* ``host_s{1,2,3}``: the same model built on the host in fp32, bf16 training, optimizer on the device.
* ``device_s3``: built on the device in fp32, bf16 ZeRO-3.
* ``init_remote_s3``: built inside ``zero.Init(remote_device="cpu")`` with parameters offloaded.

Implementations: ``ours`` (this repository), ``before`` (an older copy of this package extracted into
``--before-path``, to compare a change with the code it replaces), ``upstream`` (DeepSpeed 0.19.8 from
``--upstream-path``). Usage (GPU machine)::

    python benchmarks/init_paths.py --out DIR [--impls ours,before,upstream] [--configs ...] [--model qwen2-3b]
    python benchmarks/init_paths.py --out DIR --smoke         # CPU, tiny model: checks the harness only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
GiB = float(1 << 30)

CONFIGS: dict[str, dict] = {
    "host_offload_s3": {"stage": 3, "dtype": "bf16", "offload": True, "build": "host"},
    "host_offload_s3_fp32": {"stage": 3, "dtype": "fp32", "offload": True, "build": "host"},
    "host_s1": {"stage": 1, "dtype": "bf16", "build": "host"},
    "host_s2": {"stage": 2, "dtype": "bf16", "build": "host"},
    "host_s3": {"stage": 3, "dtype": "bf16", "build": "host"},
    "device_s3": {"stage": 3, "dtype": "bf16", "build": "device"},
    "init_remote_s3": {"stage": 3, "dtype": "bf16", "build": "zero_init_remote", "offload_param": True},
}


def _config(spec: dict, hidden: int) -> dict:
    zero: dict = {
        "stage": spec["stage"],
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": hidden * hidden,
    }
    if spec["stage"] == 3:
        zero.update(
            stage3_prefetch_bucket_size=int(0.9 * hidden * hidden), stage3_param_persistence_threshold=10 * hidden
        )
    if spec.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if spec.get("offload_param"):
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
    }
    if spec["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def worker(spec: dict) -> dict:
    """Run one configuration in this process (see the module docstring)."""
    import torch

    sys.path.insert(0, str(BENCH))
    import deepspeed
    from models import MODELS, build_model, random_batch

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec.get("port", 29511))
    )
    deepspeed.init_distributed()
    cfg_model = MODELS[spec["model"]]
    ds_cfg = _config(spec, cfg_model.hidden)
    torch.set_num_threads(int(spec.get("threads", 4)))
    if spec["build"] == "zero_init_remote":
        with deepspeed.zero.Init(remote_device="cpu", config_dict_or_path=ds_cfg):
            model = build_model(spec["model"], dev, torch.bfloat16)
    else:
        model = build_model(spec["model"], dev if spec["build"] == "device" else torch.device("cpu"), torch.float32)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_cfg)
    if cuda:
        torch.cuda.synchronize()
    init_s = time.perf_counter() - t0
    out = {
        "params": n_params,
        "init_s": init_s,
        "deepspeed_file": deepspeed.__file__,
        "working_bytes_per_param": 2 if spec["dtype"] == "bf16" else 4,
    }
    if cuda:
        out.update(
            alloc_before_init_gib=before / GiB,
            init_peak_alloc_gib=torch.cuda.max_memory_allocated() / GiB,
            alloc_after_init_gib=torch.cuda.memory_allocated() / GiB,
            reserved_after_init_gib=torch.cuda.memory_reserved() / GiB,
        )
        out["reserved_over_alloc"] = out["reserved_after_init_gib"] / max(out["alloc_after_init_gib"], 1e-9)
        torch.cuda.reset_peak_memory_stats()
    ids, labels = random_batch(cfg_model, 1, dev)
    loss = engine(ids, labels)
    engine.backward(loss)
    engine.step()
    if cuda:
        torch.cuda.synchronize()
        out["first_step_peak_alloc_gib"] = torch.cuda.max_memory_allocated() / GiB
    out["first_loss"] = float(loss)
    return out


def _pythonpath(impl: str, args: argparse.Namespace) -> str:
    site = [args.extra_site] if args.extra_site else []
    root = {"ours": str(REPO), "before": args.before_path, "upstream": args.upstream_path}[impl]
    return os.pathsep.join([root, *site])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--impls", default="ours,before,upstream")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--model", default="qwen2-3b")
    ap.add_argument("--before-path", default=str(REPO / ".before_ds"))
    ap.add_argument("--upstream-path", default="/tmp/upstream_ds")
    ap.add_argument("--extra-site", default=os.environ.get("BENCH_EXTRA_SITE"))
    ap.add_argument("--timeout-s", type=float, default=240)
    ap.add_argument("--jobs", type=int, default=1, help="workers at once (device counters are per process)")
    ap.add_argument(
        "--compare",
        default="host_offload_s3,host_offload_s3_fp32,host_s3",
        help="configurations also run for the implementations other than ours",
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, ours only")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        try:
            result = {"status": "ok", **worker(spec)}
        except Exception as err:  # noqa: BLE001 - a failed configuration is a record, not a crash of the suite
            result = {"status": "error", "error": f"{type(err).__name__}: {err}"[:2000]}
        Path(spec["result"]).write_text(json.dumps(result))
        return
    if args.smoke:
        args.impls, args.model = "ours", "quick-qwen"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    pairs = [
        (i, c)
        for c in args.configs.split(",")
        for i in args.impls.split(",")
        if i == "ours" or c in args.compare.split(",")
    ]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for record in pool.map(lambda job: _run_one(job[0], *job[1], args, out_dir), enumerate(pairs)):
            with (out_dir / "init_paths.jsonl").open("a") as fh:
                fh.write(json.dumps(record) + "\n")
            print(json.dumps(record), flush=True)


def _run_one(n: int, impl: str, name: str, args: argparse.Namespace, out_dir: Path) -> dict:
    """One worker process; its result file becomes a record (errors and time-outs included)."""
    spec = {
        **CONFIGS[name],
        "config": name,
        "impl": impl,
        "model": args.model,
        "port": 29600 + n,
        "threads": max(1, (os.cpu_count() or 2) // args.jobs),
        "result": str(out_dir / f".result_{n}.json"),
    }
    env = {**os.environ, "PYTHONPATH": _pythonpath(impl, args), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--out", str(out_dir), "--worker", json.dumps(spec)],
            env=env,
            cwd="/" if impl != "ours" else str(REPO),
            timeout=args.timeout_s,
            capture_output=True,
            text=True,
        )
        result = (
            json.loads(Path(spec["result"]).read_text())
            if Path(spec["result"]).exists()
            else {"status": "error", "error": proc.stderr[-2000:]}
        )
    except subprocess.TimeoutExpired:
        result = {"status": "timeout"}
    return {"config": name, "impl": impl, "model": args.model, "wall_s": time.perf_counter() - t0, **result}


if __name__ == "__main__":
    main()
