"""Long sequences on one GPU: which lengths a full training step completes at, with peak memory and step time.

    PYTHONPATH=. python benchmarks/long_context_gpu.py --impl ours --tile-mlp 8 --tile-loss 16 --act-offload \
        --lengths 32768,131072,262144 --budget-s 200 --out OUT.jsonl
    python benchmarks/long_context_gpu.py --impl upstream --upstream-target /tmp/upstream_ds ...   (DeepSpeed 0.19.8)

One process builds the Qwen2-shaped 3B decoder of ``benchmarks/models.py`` (random weights, bf16, activation
checkpointing inside every decoder layer) once, wraps it in ZeRO-3 with the optimizer offloaded to pinned host
memory (the S3 scenario's HF-``"auto"`` config, ``_harness.hf_auto_config``), and runs one full training step
(forward, backward, ``engine.step()``) at each length of ``--lengths`` in increasing order. Switches, the same
for both packages (upstream's ALST API): ``--tile-mlp N`` runs every MLP under ``TiledMLP`` with N shards,
``--tile-loss N`` the head and its cross-entropy under ``TiledFusedLogitsLoss``, ``--act-offload`` wraps each
step in ``get_checkpoint_hidden_states_offloading_ctx_manager()`` and marks every decoder layer's input (the
checkpointed hidden states) for it. With none of them the row is the plain model.

Memory is monotone in the length, so the first length that runs out of device memory ends the run: the record
then brackets the maximum length between the last length that completed and that one (an engine interrupted
mid-backward is not reused). A length whose step would not fit in what is left of ``--budget-s`` (estimated from
the previous step's time, scaled by the square of the length ratio, attention's cost) is not tried; the record
says so. Each line of the output is one JSON record per length: ``{"seq", "status", "peak_alloc_gib",
"peak_reserved_gib", "step_s", "host_rss_gib", ...}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
GiB = float(1 << 30)


def _paths(args: argparse.Namespace) -> None:
    # Upstream's package must come before this repository on the path; ours needs the repository root.
    sys.path.insert(0, str(BENCH))
    from _harness import one_rank_env

    one_rank_env()
    sys.path.insert(0, args.upstream_target if args.impl == "upstream" else str(BENCH.parent))


def _engine(args: argparse.Namespace) -> tuple[Any, Any, int]:
    import torch

    import deepspeed
    import models
    from _harness import DeepSpeedTrainer, default_checkpoint_reentrant, hf_auto_config
    from models import MODELS, build_model, with_tiles

    spec = {"impl": args.impl, "stage": 3, "offload": True}
    # The checkpoint form the S3 scenario uses for each package (upstream's ZeRO-3 needs the reentrant one).
    models.CHECKPOINT_USE_REENTRANT = default_checkpoint_reentrant(spec)
    name = with_tiles(args.model, args.tile_mlp, args.tile_loss)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(name, device, torch.bfloat16)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    trainer = DeepSpeedTrainer(model, spec, config=hf_auto_config(spec, MODELS[name].hidden))
    assert deepspeed.__file__.startswith(args.upstream_target) == (args.impl == "upstream"), deepspeed.__file__
    return trainer, MODELS[name], params


def _offload_context(args: argparse.Namespace, engine: Any) -> Any:
    """The hidden-states offload manager, with a pre-hook marking each decoder layer's input, or ``None``."""
    if not args.act_offload:
        return None
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager,
    )
    from models import decoder_layers

    manager = get_checkpoint_hidden_states_offloading_ctx_manager()
    for layer in decoder_layers(engine.module):
        layer.register_forward_pre_hook(lambda _m, inputs: manager.mark(inputs[0]) if inputs else None)
    return manager


def _step(trainer: Any, manager: Any, cfg: Any, seq: int) -> dict:
    import torch

    from _harness import RssSampler

    cuda = torch.cuda.is_available()
    ids, labels = _batch(seq, cfg.vocab, torch.device("cuda" if cuda else "cpu"))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    sampler = RssSampler()
    start = time.perf_counter()
    with sampler:
        with manager if manager is not None else nullcontext():
            loss = trainer.loss(ids, labels)
            trainer.backward(loss)
        trainer.step()
    if cuda:
        torch.cuda.synchronize()
    out = {
        "step_s": round(time.perf_counter() - start, 3),
        "loss": float(loss.detach()),
        "host_rss_gib": sampler.peak / GiB,
    }
    if manager is not None:  # what the offloader did (upstream's counters, same names here)
        out["offload_stats"] = {k: v for k, v in vars(manager.stats).items() if isinstance(v, (int, float))}
    if cuda:
        out["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / GiB
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
    return out


def _batch(seq: int, vocab: int, device: Any) -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(seq)
    tokens = torch.randint(0, vocab, (1, seq + 1), generator=gen).to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", choices=["ours", "upstream"], default="ours")
    ap.add_argument("--upstream-target", default="/tmp/upstream_ds")
    ap.add_argument("--model", default="qwen2-3b")
    ap.add_argument("--tile-mlp", type=int, default=0)
    ap.add_argument("--tile-loss", type=int, default=0)
    ap.add_argument("--act-offload", action="store_true")
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--warmup-seq", type=int, default=0, help="one step at this length first (recorded as warmup)")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--row", default=None, help="row name in the records (default: from the switches)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    _paths(args)

    t0 = time.perf_counter()
    where = "offload" if args.act_offload else "resident"
    row = args.row or f"{args.impl}:mlp{args.tile_mlp}:loss{args.tile_loss}:{where}"
    trainer, cfg, params = _engine(args)
    manager = _offload_context(args, trainer.engine)
    base = {
        "row": row,
        "impl": args.impl,
        "model": args.model,
        "params": params,
        "tile_mlp": args.tile_mlp,
        "tile_loss": args.tile_loss,
        "act_offload": args.act_offload,
        "device": _device_name(),
        "setup_s": round(time.perf_counter() - t0, 1),
    }
    last: tuple[int, float] | None = None
    with args.out.open("a") as sink:
        if args.warmup_seq:
            record = {"seq": args.warmup_seq, "status": "warmup", **_step(trainer, manager, cfg, args.warmup_seq)}
            print(json.dumps({**base, **record}), file=sink, flush=True)
        for seq in sorted(int(s) for s in args.lengths.split(",")):
            record = attempt(
                seq, lambda seq=seq: _step(trainer, manager, cfg, seq), args.budget_s - (time.perf_counter() - t0), last
            )
            if record["status"] == "ok":
                last = (seq, record["step_s"])
            print(json.dumps({**base, **record}), file=sink, flush=True)
            print(row, record, flush=True)
            if record["status"] != "ok":
                break
    gc.collect()


def attempt(seq: int, measure: Callable[[], dict], left_s: float, last: tuple[int, float] | None) -> dict:
    """One length's record: ``measure()``'s figures (status ``ok``), ``oom``, or ``not tried`` when the step time
    of the last length that ran, scaled by the square of the length ratio, exceeds the ``left_s`` seconds left."""
    import torch

    guess = last[1] * (seq / last[0]) ** 2 if last else 0.0
    if last and guess > left_s:
        return {"seq": seq, "status": "not tried", "why": f"estimated {guess:.0f} s > {left_s:.0f} s left"}
    try:
        return {"seq": seq, "status": "ok", **measure()}
    except torch.OutOfMemoryError as err:
        return {"seq": seq, "status": "oom", "error": str(err).splitlines()[0][:300]}


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
