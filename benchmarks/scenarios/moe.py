"""MoE benchmark: a small MoE GPT (8 experts, top-2) under ZeRO-2, ours against upstream DeepSpeed in the same run.

Two roles in one file:

* driver: ``python benchmarks/scenarios/moe.py --out DIR [--smoke] [--world-sizes 1,8] [--impls ours,upstream]
  [--upstream-target /tmp/upstream_ds] [--extra-site /tmp/site]`` runs one worker process per (implementation,
  world size) and appends every record to ``DIR/moe.jsonl``;
* worker: ``--spec JSON --result FILE`` (``_harness.worker_main``), started by the driver.

World size 1 is a real one-rank group; larger sizes run rank 0 of a simulated job over PyTorch's fake process
group with ``ep_size`` = world size (capped at the expert count), so each rank holds 8 / ep_size experts and the
recorded peak memory is a real rank's: the expert-parallel memory per rank. Collectives move no data there, so
throughput is only meaningful at world size 1. Every record holds ``deepspeed_file`` (which package ran),
tokens/s (median step), peak allocated/reserved GiB over the timed steps and the parameter counts. ``--smoke`` is a
seconds-long CPU run of the same code with a tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = HERE.parents[2]
FULL = {
    "vocab": 32000,
    "hidden": 1024,
    "layers": 8,
    "heads": 16,
    "seq": 1024,
    "micro_batch": 4,
    "experts": 8,
    "k": 2,
    "steps": 6,
    "warmup": 2,
}
SMOKE = {
    "vocab": 256,
    "hidden": 32,
    "layers": 2,
    "heads": 4,
    "seq": 16,
    "micro_batch": 2,
    "experts": 8,
    "k": 2,
    "steps": 2,
    "warmup": 1,
}


# ----------------------------------------------------------------------------------------------- model
class _Block(torch.nn.Module):
    def __init__(self, cfg: dict, ep_size: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        h = cfg["hidden"]
        self.heads = cfg["heads"]
        self.ln1 = torch.nn.LayerNorm(h)
        self.qkv = torch.nn.Linear(h, 3 * h)
        self.proj = torch.nn.Linear(h, h)
        self.ln2 = torch.nn.LayerNorm(h)
        expert = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h))
        self.moe = MoE(
            h,
            expert,
            num_experts=cfg["experts"],
            ep_size=ep_size,
            k=cfg["k"],
            capacity_factor=1.25,
            eval_capacity_factor=1.25,
            min_capacity=4,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(att)
        out, l_aux, _ = self.moe(self.ln2(x))
        return x + out, l_aux


class MoEGPT(torch.nn.Module):
    """Embedding, ``layers`` blocks of causal attention + MoE feed-forward, untied head."""

    def __init__(self, cfg: dict, ep_size: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(cfg["vocab"], cfg["hidden"])
        self.blocks = torch.nn.ModuleList([_Block(cfg, ep_size) for _ in range(cfg["layers"])])
        self.ln = torch.nn.LayerNorm(cfg["hidden"])
        self.head = torch.nn.Linear(cfg["hidden"], cfg["vocab"], bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        aux = 0.0
        for block in self.blocks:
            x, l_aux = block(x)
            aux = aux + l_aux
        logits = self.head(self.ln(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1)) + 0.01 * aux


# ----------------------------------------------------------------------------------------------- worker
def _config(cfg: dict, dtype: str) -> dict:
    out = {
        "train_micro_batch_size_per_gpu": cfg["micro_batch"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": int(5e8),
            "allgather_bucket_size": int(5e8),
            "overlap_comm": True,
            "reduce_scatter": True,
            "contiguous_gradients": True,
        },
    }
    if dtype == "bf16":
        out["bf16"] = {"enabled": True}
    return out


def run(spec: dict) -> dict:
    """Build the model, train ``warmup`` + ``steps`` steps, report tokens/s and peak memory."""
    import deepspeed
    from _harness import DTYPES, device, make_optimizer, mem, reset_peak, sync
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    cfg = SMOKE if spec.get("smoke") else FULL
    ep_size = int(spec["ep_size"])
    dev = device()
    torch.manual_seed(0)
    model = MoEGPT(cfg, ep_size).to(device=dev, dtype=DTYPES[spec["dtype"]])
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "params"}
    )
    engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(groups), config=_config(cfg, spec["dtype"]))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab"], (cfg["micro_batch"], cfg["seq"]), generator=g).to(dev)
    labels = torch.roll(ids, -1, dims=1)

    def one_step() -> float:
        loss = engine(ids, labels)
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    for _ in range(cfg["warmup"]):
        one_step()
    sync()
    reset_peak()
    times, losses = [], []
    for _ in range(cfg["steps"]):
        t0 = time.perf_counter()
        losses.append(one_step())
        sync()
        times.append(time.perf_counter() - t0)
    median = sorted(times)[len(times) // 2]
    expert = sum(p.numel() for n, p in model.named_parameters() if "deepspeed_experts" in n)
    return {
        "model_cfg": cfg,
        "params_local": sum(p.numel() for p in model.parameters()),
        "expert_params_local": expert,
        "step_times_s": times,
        "median_step_s": median,
        "tokens_per_s": cfg["micro_batch"] * cfg["seq"] / median,
        "losses": losses,
        "memory_gib": mem(),
        "deepspeed_file": deepspeed.__file__,
        "deepspeed_version": getattr(deepspeed, "__version__", "?"),
        "skipped_steps": int(getattr(engine, "skipped_steps", 0) or 0),
    }


# ----------------------------------------------------------------------------------------------- driver
def _env(impl: str, args: argparse.Namespace, port: int) -> dict:
    from _harness import single_worker_env

    return single_worker_env(impl, args.upstream_target, args.extra_site, port, args.smoke)


def _run_one(spec: dict, args: argparse.Namespace, port: int, tmp: str) -> dict:
    result = os.path.join(tmp, f"r{port}.json")
    cmd = [sys.executable, str(HERE), "--spec", json.dumps(spec), "--result", result]
    proc = subprocess.run(
        cmd, env=_env(spec["impl"], args, port), cwd="/tmp", capture_output=True, text=True, timeout=args.job_timeout_s
    )
    if os.path.exists(result):
        with open(result) as f:
            return json.load(f)
    return {
        **spec,
        "status": "error",
        "error": f"worker exited {proc.returncode}",
        "log_tail": proc.stdout[-2000:] + proc.stderr[-2000:],
    }


def driver(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU (seconds)")
    ap.add_argument("--world-sizes", default="1,8")
    ap.add_argument("--impls", default="ours,upstream")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--upstream-target", default="/tmp/upstream_ds")
    ap.add_argument("--extra-site", default="/tmp/site")
    ap.add_argument("--job-timeout-s", type=float, default=300.0)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, "moe.jsonl")
    experts = (SMOKE if args.smoke else FULL)["experts"]
    port = 29650
    with tempfile.TemporaryDirectory() as tmp:
        for world in [int(w) for w in args.world_sizes.split(",")]:
            for impl in args.impls.split(","):
                spec = {
                    "scenario": "moe",
                    "impl": impl,
                    "world_size": world,
                    "ep_size": min(world, experts),
                    "dtype": "fp32" if args.smoke else args.dtype,
                    "smoke": bool(args.smoke),
                }
                port += 1
                try:
                    record = _run_one(spec, args, port, tmp)
                except subprocess.TimeoutExpired:
                    record = {**spec, "status": "error", "error": f"timed out after {args.job_timeout_s} s"}
                with open(out_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
                print(
                    json.dumps(
                        {
                            k: record.get(k)
                            for k in ("impl", "world_size", "ep_size", "status", "tokens_per_s", "memory_gib", "error")
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    if "--spec" in sys.argv:
        from _harness import worker_main

        worker_main("moe", run)
    else:
        driver(sys.argv[1:])
