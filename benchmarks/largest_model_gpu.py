"""The largest model that trains one step on one GPU with its host memory, by bisection over the layer count.

    PYTHONPATH=. python benchmarks/largest_model_gpu.py --impl ours --states fp32 --bisect 36,200 --budget-s 300 \
        --out OUT.jsonl
    python benchmarks/largest_model_gpu.py --impl upstream --upstream-target /tmp/upstream_ds ...   (DeepSpeed 0.19.8)

Every trial is its own process (a fresh device and a fresh host heap; a trial the kernel kills for host memory
counts as a failure like a device out-of-memory): the Qwen2-shaped decoder of ``benchmarks/models.py`` (hidden 2048,
77 M parameters per layer, 0.31 B in the tied embedding) with ``--layers`` layers, bf16, activation
checkpointing, ZeRO-3 with the optimizer offloaded to pinned host memory (``--states fp32``: fp32 master and Adam
moments on the host; ``--states bf16``: ``bf16_master_weights_and_grads`` + ``bf16_optimizer_states``; ``--states
nvme``: the optimizer states in swap files under ``--nvme-path``), one training step at ``--seq`` tokens. The
bisection keeps the largest layer count that completed and the smallest that ran out of memory (a trial that
times out or fails otherwise settles nothing and ends the search), and stops when they meet or when the next
trial would not fit in what is left of ``--budget-s`` (estimated from the slowest trial so far).
One JSON record per trial: ``{"layers", "params", "status", "seconds", "host_rss_gib", "peak_alloc_gib"}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
GiB = float(1 << 30)


def _config(args: argparse.Namespace) -> dict:
    bf16: dict = {"enabled": True}
    offload: dict = {"device": "cpu", "pin_memory": True}
    if args.states == "bf16":
        bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    if args.states == "nvme":
        offload = {"device": "nvme", "nvme_path": args.nvme_path, "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 1.0,
        "bf16": bf16,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "offload_optimizer": offload},
    }


def trial(args: argparse.Namespace) -> dict:
    """One training step of the ``args.layers``-layer model; the record of how it went."""
    sys.path.insert(0, str(BENCH))
    from _harness import one_rank_env

    one_rank_env()
    sys.path.insert(0, args.upstream_target if args.impl == "upstream" else str(BENCH.parent))
    import dataclasses

    import psutil
    import torch

    import deepspeed
    from models import MODELS, build_model

    MODELS["largest"] = dataclasses.replace(MODELS[args.model], layers=args.layers, seq=args.seq)
    if args.states == "nvme":
        Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model("largest", device, torch.bfloat16)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    engine, *_ = deepspeed.initialize(model=model, config=_config(args))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MODELS["largest"].vocab, (1, args.seq + 1), generator=gen).to(device)
    engine.backward(engine(ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    engine.step()
    out = {"params": params, "host_rss_gib": psutil.Process().memory_info().rss / GiB}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        out["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / GiB
    return out


_TRIAL_KEYS = ("impl", "upstream_target", "states", "model", "seq", "nvme_path")


def _spawn(args: argparse.Namespace, layers: int, limit: float) -> dict:
    cmd = [sys.executable, __file__, "--trial", "--layers", str(layers)] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in _TRIAL_KEYS
    ]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"layers": layers, "status": "timeout", "seconds": round(time.perf_counter() - start, 1)}
    seconds = round(time.perf_counter() - start, 1)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return {"layers": layers, "status": "ok", "seconds": seconds, **json.loads(lines[-1])}
    why = "killed (host memory)" if done.returncode in (-9, 137) else (done.stderr.strip().splitlines() or ["?"])[-1]
    status = "oom" if "out of memory" in why.lower() or "killed" in why else "error"
    return {"layers": layers, "status": status, "seconds": seconds, "why": why[:300]}


def bisect(args: argparse.Namespace) -> None:
    """Bisect the layer count in ``args.bisect`` (``LO,HI``), appending one record per trial to ``args.out``."""
    lo, hi = (int(x) for x in args.bisect.split(","))
    good, bad, slowest, start = None, None, 0.0, time.perf_counter()
    layers = lo
    with args.out.open("a") as sink:
        while True:
            left = args.budget_s - (time.perf_counter() - start)
            if slowest * 1.5 > left:
                break
            record = {"impl": args.impl, "states": args.states, **_spawn(args, layers, left)}
            print(json.dumps(record), file=sink, flush=True)
            print(record, flush=True)
            slowest = max(slowest, record["seconds"])
            if record["status"] in ("timeout", "error"):
                break  # no verdict on this size: neither bound moves
            if record["status"] == "ok":
                good = layers
            else:
                bad = layers
            if good is None:
                break
            if bad is None:
                layers = hi if layers < hi else layers * 2
            elif bad - good <= max(1, good // 16):
                break
            else:
                layers = (good + bad) // 2
        print(
            json.dumps(
                {"impl": args.impl, "states": args.states, "largest_ok_layers": good, "smallest_failed_layers": bad}
            ),
            file=sink,
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", choices=["ours", "upstream"], default="ours")
    ap.add_argument("--upstream-target", default="/tmp/upstream_ds")
    ap.add_argument("--states", choices=["fp32", "bf16", "nvme"], default="fp32")
    ap.add_argument("--nvme-path", default="/tmp/nvme_swap")
    ap.add_argument("--model", default="qwen2-3b", help="the layer shape (a key of models.MODELS)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--trial", action="store_true", help="run one trial in this process and print its record")
    ap.add_argument("--bisect", default="36,144", help="LO,HI: the first trial at LO, then HI, then bisection")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=Path("largest_model.jsonl"))
    args = ap.parse_args()
    if args.trial:
        print(json.dumps(trial(args)), flush=True)
    else:
        bisect(args)


if __name__ == "__main__":
    main()
