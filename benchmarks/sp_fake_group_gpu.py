"""Per-rank device memory of Ulysses sequence parallelism (SP) at SP=8, simulated on one GPU.

    PYTHONPATH=. python benchmarks/sp_fake_group_gpu.py --tile-mlp 8 --tile-loss 16 --act-offload \
        --lengths 131072,524288 --budget-s 140 --out OUT.jsonl

One process is rank 0 of an 8-rank job over PyTorch's fake process group (``FakeStore``, backend ``"fake"``):
ranks, group sizes and subgroups are those of the real job, but collectives return at once without moving data,
so every tensor this rank allocates (its parameter shards, the gathered layers, the exchanged attention inputs,
its activations) has the size it has in the real job, and the allocator's peaks are this rank's. The values are
not: gathered parameters and exchanged activations hold whatever the buffers held, so the loss is meaningless.
Step time leaves out all communication (and rank 0 does one rank's share of the compute).

The model is the Qwen2-shaped 3B decoder of ``benchmarks/models.py`` (random weights, bf16, every decoder layer
checkpointed), built inside ``deepspeed.zero.Init`` (the full model never exists on the rank) and wrapped by this
package's engine with ZeRO-3, the optimizer offloaded to pinned host memory (``_harness.hf_auto_config``) and
``sequence_parallel_size: 8``; the engine creates the SP groups. Every attention runs through the ALST API's
``UlyssesSPAttentionHF`` over the SP group: the model's q/k/v of this rank's ``S / 8`` tokens go through the
all-to-all, an SDPA core attends over all ``S`` tokens for this rank's heads, and the inverse exchange returns the
rank's tokens (each layer's own projections and rotary embeddings run on the shard; rank 0's shard holds positions
``[0, S/8)``, which is what the model's rotary tables give). The ALST switches are those of
``long_context_gpu.py``: ``--tile-mlp N`` (``TiledMLP``), ``--tile-loss N`` (``TiledFusedLogitsLoss``, on the rank's
tokens), ``--act-offload`` (the hidden-states offload manager, every decoder layer's input marked).

Each length of ``--lengths`` (total tokens of the sequence, divisible by 8) is trained for ``--steps`` full steps
(forward, backward, ``engine.step()``) in increasing order; the first that runs out of device memory ends the run,
and a length whose estimated step would not fit in what is left of ``--budget-s`` is not tried (as in
``long_context_gpu.py``). One JSON line per length: ``{"seq", "seq_per_rank", "status", "peak_alloc_gib",
"peak_reserved_gib", "step_s", "floor_gib", "floor_parts_gib", ...}``. The floor is docs/long_context.md's
per-rank accounting at ``s = S / 8`` tokens (see :func:`floor_parts`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
GiB = float(1 << 30)
SP = 8
BF16 = 2  # bytes per element of the 16-bit activations and weights


def _paths() -> None:
    sys.path.insert(0, str(BENCH))
    from _harness import one_rank_env

    one_rank_env()
    sys.path.insert(0, str(BENCH.parent))


def _fake_group(world: int) -> None:
    import torch.distributed as td
    from torch.testing._internal.distributed.fake_pg import FakeStore

    td.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def _model_name(args: argparse.Namespace) -> str:
    from models import MODELS, with_tiles

    name = args.model
    if args.heads:  # a narrower head split of the same model (the CPU smoke test's tiny model needs 8 heads)
        name = f"{args.model}@heads{args.heads}"
        MODELS[name] = dataclasses.replace(MODELS[args.model], heads=args.heads)
    return with_tiles(name, args.tile_mlp, args.tile_loss)


def _engine(args: argparse.Namespace) -> tuple[Any, Any, int]:
    import torch

    import deepspeed
    from _harness import DeepSpeedTrainer, hf_auto_config
    from models import MODELS, build_model

    name = _model_name(args)
    cfg = MODELS[name]
    spec = {"impl": "ours", "stage": 3, "offload": True, "world_size": SP}
    config = {**hf_auto_config(spec, cfg.hidden), "sequence_parallel_size": SP}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = build_model(name, device, torch.bfloat16)
    params = sum(int(getattr(p, "ds_numel", p.numel())) for p in {id(p): p for p in model.parameters()}.values())
    trainer = DeepSpeedTrainer(model, spec, config=config)
    assert trainer.engine.sequence_parallel_size == SP
    return trainer, cfg, params


# ----------------------------------------------------------------------------------------------- SP attention
class SdpaCore:
    """The core attention in Hugging Face's calling form (``[b, heads, S, d]`` in, ``[b, S, heads, d]`` out);
    ``tokens`` is the longest sequence it attended over (the whole ``S`` when the exchange ran)."""

    def __init__(self) -> None:
        self.tokens = 0

    def __call__(self, module: Any, query: Any, key: Any, value: Any, mask: Any, **_: Any) -> tuple[Any, None]:
        import torch.nn.functional as F

        self.tokens = max(self.tokens, int(query.shape[2]))
        groups = query.shape[1] // key.shape[1]
        if groups > 1:  # this rank's query heads share its key/value heads
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None)
        return out.transpose(1, 2), None


def _sp_attention(attn: Any, wrapper: Any, x: Any, cos: Any, sin: Any) -> Any:
    """``QwenAttention.forward`` with the core attention run sequence-parallel by ``wrapper``."""
    import torch

    from models import _rotate_half

    b, s, _ = x.shape
    q = attn.q_proj(x).view(b, s, attn.heads, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(b, s, attn.kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(b, s, attn.kv_heads, attn.head_dim).transpose(1, 2)
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    start = wrapper.sp_rank * s
    positions = torch.arange(start, start + s, device=x.device).unsqueeze(0).expand(b, s)
    context, _ = wrapper(attn, q, k, v, None, position_ids=positions)
    return attn.o_proj(context)


def install_sp_attention(model: Any, cfg: Any) -> Any:
    """Route every decoder layer's attention through one ``UlyssesSPAttentionHF`` over the engine's SP group."""
    from deepspeed.runtime.sequence_parallel.parallel_state_sp import get_sequence_parallel_group
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from models import decoder_layers

    wrapper = UlyssesSPAttentionHF(
        attn=SdpaCore(),
        batch_size=1,
        attn_head_count=cfg.heads,
        attn_head_size=cfg.head_dim,
        kv_head_count=cfg.kv_heads,
        num_hidden_layers=cfg.layers,
        process_group=get_sequence_parallel_group(),
        seq_length_is_variable=True,
    )
    for layer in decoder_layers(model):
        layer.self_attn.forward = functools.partial(_sp_attention, layer.self_attn, wrapper)
    return wrapper


# ----------------------------------------------------------------------------------------------- the floor
def floor_parts(cfg: Any, params: int, seq: int, args: argparse.Namespace) -> dict[str, float]:
    """One rank's floor at ``seq`` total tokens, in GiB per part (docs/long_context.md's terms at ``s = seq/8``).

    ``states``: ZeRO-3 with the optimizer offloaded keeps ``4/N`` bytes a parameter on the device
    (``floors.bytes_per_param``, N = 8: its 16-bit parameter and gradient shards). ``gathered``: the largest fetch
    unit's 16-bit weights in full while it computes. ``activations``: the embedding output and its gradient
    (``2·s·h·e``), the checkpointed layer inputs (``2·s·h·e`` with the hidden-states offload, else ``L·s·h·e``),
    one layer's recompute (``s·(4h + 2·h_kv)·e``), the SP exchange's q/k/v/output (``s·(2h + 2·h_x)·e``, ``h_x`` the
    key/value width as exchanged: key/value heads are repeated up to 8 when there are fewer), the MLP's intermediate
    (``4·ceil(s/n)·i·e`` with ``n`` MLP tiles, ``n`` = 1 untiled) and the logits (``ceil(s/n)·v·(e + 8)`` with ``n``
    loss tiles).
    """
    from floors import bytes_per_param

    s, h, e = seq // SP, cfg.hidden, BF16
    h_kv = cfg.kv_heads * cfg.head_dim
    h_x = max(cfg.kv_heads, SP) * cfg.head_dim
    inputs = (2 if args.act_offload else cfg.layers) * s * h * e
    per_layer = s * (4 * h + 2 * h_kv) * e + s * (2 * h + 2 * h_x) * e
    mlp = 4 * math.ceil(s / max(1, args.tile_mlp)) * cfg.intermediate * e
    logits = math.ceil(s / max(1, args.tile_loss)) * cfg.vocab * (e + 8)
    parts = {
        "states": bytes_per_param("ours", 3, SP, offload=True)[0] * params,
        "gathered": cfg.largest_layer_params() * e,
        "activations": 2 * s * h * e + inputs + per_layer + mlp + logits,
    }
    return {k: round(v / GiB, 6) for k, v in parts.items()}


# ----------------------------------------------------------------------------------------------- the run
def _measure(trainer: Any, manager: Any, cfg: Any, seq: int, steps: int) -> dict:
    """``steps`` full steps on rank 0's ``seq / 8`` tokens; peaks are the largest of the steps, time the last."""
    from long_context_gpu import _step

    runs = [_step(trainer, manager, cfg, seq // SP) for _ in range(steps)]
    out = dict(runs[-1])
    for key in ("peak_alloc_gib", "peak_reserved_gib", "host_rss_gib"):
        if key in out:
            out[key] = round(max(r[key] for r in runs), 3)
    out["step_s_all"] = [r["step_s"] for r in runs]
    return out


def _layout(engine: Any) -> dict:
    """What the engine made of the fake world: its SP size, the ZeRO group's size, this rank's parameter shard."""
    unique = {id(p): p for p in engine.module.parameters()}.values()
    return {
        "engine_sp": int(engine.sequence_parallel_size),
        "zero_world_size": int(engine.seq_dp_world_size),
        "param_shard_numel": sum(int(p.ds_tensor.numel()) for p in unique),
    }


def _lengths(text: str) -> list[int]:
    lengths = sorted(int(s) for s in text.split(","))
    bad = [n for n in lengths if n <= 0 or n % SP]
    if bad:
        raise SystemExit(f"--lengths: every length must be a positive multiple of {SP}; got {bad}")
    return lengths


def _record(trainer: Any, manager: Any, cfg: Any, seq: int, args: argparse.Namespace, last: Any, t0: float) -> dict:
    from long_context_gpu import attempt

    left = args.budget_s - (time.perf_counter() - t0)
    return attempt(seq, lambda: _measure(trainer, manager, cfg, seq, args.steps), left, last)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2-3b")
    ap.add_argument("--heads", type=int, default=0, help="override the model's attention head count")
    ap.add_argument("--tile-mlp", type=int, default=0)
    ap.add_argument("--tile-loss", type=int, default=0)
    ap.add_argument("--act-offload", action="store_true")
    ap.add_argument("--lengths", default="131072,524288", help="total sequence lengths (each rank holds 1/8)")
    ap.add_argument("--steps", type=int, default=1, help="full training steps per length")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--row", default=None, help="row name in the records (default: from the switches)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    lengths = _lengths(args.lengths)
    _paths()
    from long_context_gpu import _device_name, _offload_context

    t0 = time.perf_counter()
    _fake_group(SP)
    trainer, cfg, params = _engine(args)
    core = install_sp_attention(trainer.engine.module, cfg).attn
    manager = _offload_context(args, trainer.engine)
    where = "offload" if args.act_offload else "resident"
    row = args.row or f"sp{SP}:mlp{args.tile_mlp}:loss{args.tile_loss}:{where}"
    base = {
        "row": row,
        "model": args.model,
        "heads": cfg.heads,
        "params": params,
        "sp": SP,
        "world_size": SP,
        "tile_mlp": args.tile_mlp,
        "tile_loss": args.tile_loss,
        "act_offload": args.act_offload,
        **_layout(trainer.engine),
        "device": _device_name(),
        "setup_s": round(time.perf_counter() - t0, 1),
    }
    last: tuple[int, float] | None = None
    with args.out.open("a") as sink:
        for seq in lengths:
            core.tokens = 0
            record = {"seq_per_rank": seq // SP, **_record(trainer, manager, cfg, seq, args, last, t0)}
            if record["status"] == "ok":
                last = (seq, record["step_s"])
            if record["status"] != "not tried":
                parts = floor_parts(cfg, params, seq, args)
                record.update(attn_tokens=core.tokens, floor_parts_gib=parts, floor_gib=round(sum(parts.values()), 6))
            print(json.dumps({**base, **record}), file=sink, flush=True)
            print(row, record, flush=True)
            if record["status"] != "ok":
                break


if __name__ == "__main__":
    main()
