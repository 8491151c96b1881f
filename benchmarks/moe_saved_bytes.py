"""Bytes autograd keeps for backward per MoE layer: ours against upstream DeepSpeed, on the CPU in seconds.

``python benchmarks/moe_saved_bytes.py [--impls ours,upstream] [--upstream-target /tmp/upstream_ds]
[--tokens 4096] [--hidden 64] [--experts 8] [--k 2] [--capacity-factor 1.25] [--dtype bf16] [--detail]``

One worker process per implementation (``--worker IMPL``) builds one ``deepspeed.moe.layer.MoE`` with a
``Linear(h, 4h) - GELU - Linear(4h, h)`` expert, runs a training forward on ``tokens x hidden`` inputs and sums
the storages autograd saved for backward (``torch.autograd.graph.saved_tensors_hooks``), each storage once,
parameters left out. ``upstream`` imports ``deepspeed`` from ``--upstream-target`` (an installed wheel) instead
of this checkout. Defaults are the benchmark's MoE GPT (``benchmarks/scenarios/moe.py``) routing shape:
4096 tokens per rank, 8 experts, top-2, capacity factor 1.25; the hidden width is small so the run takes
seconds, and the per-layer terms that scale with it are printed apart (``--detail`` lists every saved tensor).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def measure(args: argparse.Namespace) -> dict:
    """Build one MoE layer, run one forward under the saved-tensor hooks, return the byte accounting."""
    import torch

    from deepspeed.moe.layer import MoE

    dtype = getattr(torch, DTYPES[args.dtype])
    torch.manual_seed(0)
    h = args.hidden
    expert = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h))
    layer = MoE(
        h,
        expert,
        num_experts=args.experts,
        ep_size=1,
        k=args.k,
        capacity_factor=args.capacity_factor,
        eval_capacity_factor=args.capacity_factor,
        min_capacity=4,
    ).to(dtype)
    layer.train()
    x = torch.randn(args.tokens, h, dtype=dtype, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, dict] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in saved and storage.nbytes() > 0:
            saved[ptr] = {
                "bytes": storage.nbytes(),
                "dtype": str(t.dtype).replace("torch.", ""),
                "shape": list(t.shape),
                "is_input": ptr == x.untyped_storage().data_ptr(),
            }
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, l_aux, _ = layer(x)
    (out.float().square().mean() + l_aux).backward()  # the graph is complete and usable
    records = sorted(saved.values(), key=lambda r: -r["bytes"])
    return {
        "deepspeed_file": sys.modules["deepspeed"].__file__,
        "saved_bytes": sum(r["bytes"] for r in records),
        "saved_bytes_without_input": sum(r["bytes"] for r in records if not r["is_input"]),
        "tensors": records,
    }


def _worker(args: argparse.Namespace) -> None:
    print(json.dumps(measure(args)))


def _run_impl(impl: str, args: argparse.Namespace, argv: list[str]) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) if impl == "ours" else args.upstream_target
    env.setdefault("DS_ACCELERATOR", "cpu")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", impl, *argv]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{impl} worker failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", default="ours,upstream")
    parser.add_argument("--upstream-target", default="/tmp/upstream_ds")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--detail", action="store_true")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    argv = [
        f"--tokens={args.tokens}",
        f"--hidden={args.hidden}",
        f"--experts={args.experts}",
        f"--k={args.k}",
        f"--capacity-factor={args.capacity_factor}",
        f"--dtype={args.dtype}",
    ]
    for impl in args.impls.split(","):
        result = _run_impl(impl, args, argv)
        mib = result["saved_bytes"] / 2**20
        print(
            f"{impl:9s} saved {result['saved_bytes']:>12,d} B ({mib:8.2f} MiB) per MoE layer; "
            f"without the layer input {result['saved_bytes_without_input']:,d} B  [{result['deepspeed_file']}]"
        )
        if args.detail:
            for r in result["tensors"]:
                print(
                    f"    {r['bytes']:>12,d}  {r['dtype']:9s} {r['shape']}{'  (layer input)' if r['is_input'] else ''}"
                )


if __name__ == "__main__":
    main()
