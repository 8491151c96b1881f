"""Train a small byte-level GPT on a public-domain text with ZeRO-3 and report loss and memory.

    deepspeed --num_gpus 2 examples/train_gpt.py --deepspeed_config examples/ds_config_gpt_zero3.json

The text is the Jargon File excerpt in ``examples/data/`` (public domain, see its README): the first 90 % of its
bytes train, the last 10 % are held out. Tokens are bytes (vocabulary 256), so nothing is downloaded. Every
``--eval_every`` steps rank 0 prints the train loss and the held-out loss; at the end the script prints the memory
of each phase (after forward / backward / step) next to the model-state floor of this ZeRO stage, and writes into
``--out``: ``metrics.json`` (losses, memory records), ``memory_phases.png`` (with matplotlib) and, on CUDA, the
engine's allocator timeline of one step (``memory_timeline_rank<r>.png/.json/.pickle``). On a machine without GPUs
the launcher starts CPU processes (gloo) and "memory" is each process's resident set size.

Exits non-zero when the held-out loss did not fall.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import deepspeed
from deepspeed.accelerator import get_accelerator

DATA = Path(__file__).parent / "data" / "jargon_file_4.4.7_lexicon_excerpt.txt"


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level GPT: token and position embeddings, ``layers`` blocks, final norm, untied head."""

    def __init__(self, layers: int, dim: int, heads: int, seq: int, vocab: int = 256) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.tok(inputs) + self.pos(torch.arange(inputs.shape[1], device=inputs.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x)).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def load_splits(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The text's bytes as token ids: (first 90 %, last 10 %)."""
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
    cut = int(0.9 * len(data))
    return data[:cut], data[cut:]


def sample(data: torch.Tensor, count: int, seq: int, seed: int) -> torch.Tensor:
    """``count`` random windows of ``seq + 1`` tokens (inputs plus the next-token targets)."""
    starts = torch.randint(0, len(data) - seq - 1, (count,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([data[s : s + seq + 1] for s in starts.tolist()])


def held_out_loss(engine: deepspeed.DeepSpeedEngine, batches: list[torch.Tensor]) -> float:
    """Mean loss over fixed held-out batches (every rank evaluates the same ones)."""
    engine.eval()
    with torch.no_grad():
        loss = sum(engine(b.to(engine.device)).item() for b in batches) / len(batches)
    engine.train()
    return loss


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--eval_every", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs/main"))
    return deepspeed.add_config_arguments(parser).parse_args()


def engine_config(path: str, out: Path) -> dict:
    """The JSON config, with the per-phase memory report on and, on CUDA, one step's allocator timeline."""
    config = json.loads(Path(path).read_text())
    config["memory_breakdown"] = True
    if get_accelerator().device_name() != "cpu":
        config["memory_timeline"] = {"enabled": True, "step": 3, "path": str(out / "memory_timeline")}
    return config


def train(
    args: argparse.Namespace,
    engine: deepspeed.DeepSpeedEngine,
    train_data: torch.Tensor,
    val_batches: list[torch.Tensor],
) -> list[dict]:
    """The loop: one optimizer step per ``gradient_accumulation_steps`` micro-batches; periodic evaluation."""
    rank, micro = deepspeed.comm.get_rank(), engine.train_micro_batch_size_per_gpu()
    history = [{"step": 0, "val_loss": held_out_loss(engine, val_batches)}]
    if rank == 0:
        print(f"step 0: held-out loss {history[0]['val_loss']:.3f} (uniform guess: {math.log(256):.3f})")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        for micro_step in range(engine.gradient_accumulation_steps()):
            tokens = sample(train_data, micro, args.seq, seed=(step * 64 + micro_step) * 1024 + rank)
            loss = engine(tokens.to(engine.device))
            engine.backward(loss)
            engine.step()
        if step % args.eval_every == 0 or step == args.steps:
            history.append(
                {
                    "step": step,
                    "train_loss": loss.item(),
                    "val_loss": held_out_loss(engine, val_batches),
                    "seconds": round(time.perf_counter() - start, 1),
                }
            )
            if rank == 0:
                h = history[-1]
                print(
                    f"step {step}: train loss {h['train_loss']:.3f}, held-out loss {h['val_loss']:.3f} "
                    f"({h['seconds']} s)"
                )
    return history


def memory_summary(records: list[dict]) -> dict[str, dict[str, float]]:
    """Per phase: the largest allocated and peak GiB seen over the run, and the model-state floor."""
    phases: dict[str, dict[str, float]] = {}
    for r in records:
        p = phases.setdefault(r["phase"], {"allocated_gib": 0.0, "peak_gib": 0.0, "floor_gib": r["floor_gib"]})
        p["allocated_gib"] = max(p["allocated_gib"], r["allocated_gib"])
        p["peak_gib"] = max(p["peak_gib"], r["peak_gib"])
    return phases


def plot_phases(records: list[dict], png: Path, what: str) -> bool:
    """Allocated memory at every phase of every step, with the floor; False when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(10, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([r["allocated_gib"] for r in records], label=f"{what} at each phase", linewidth=0.8)
    ax.plot([r["floor_gib"] for r in records], label="model-state floor (ZeRO-3, this rank)", linestyle="--")
    ax.set_xlabel("phase points (after forward / backward / step, in order)")
    ax.set_ylabel("GiB")
    ax.legend()
    fig.savefig(png, dpi=110, bbox_inches="tight")
    return True


def report(args: argparse.Namespace, engine: deepspeed.DeepSpeedEngine, history: list[dict]) -> None:
    """Rank 0 prints the memory table and writes metrics.json and the PNG."""
    # The engine keeps the memory_breakdown records of its phase points (one list per process).
    records = list(engine._loop.memory.records)
    what = "resident set size" if get_accelerator().device_name() == "cpu" else "allocated device memory"
    args.out.mkdir(parents=True, exist_ok=True)
    summary = memory_summary(records)
    print(f"memory per phase ({what}, rank 0, largest over the run):")
    for phase, m in summary.items():
        print(
            f"  {phase:<17} {m['allocated_gib']:8.3f} GiB (peak {m['peak_gib']:.3f}); "
            f"model-state floor {m['floor_gib']:.4f} GiB"
        )
    (args.out / "metrics.json").write_text(
        json.dumps(
            {"history": history, "memory_per_phase": summary, "memory_measure": what, "records": records}, indent=1
        )
    )
    drawn = plot_phases(records, args.out / "memory_phases.png", what)
    print(
        f"wrote {args.out / 'metrics.json'}"
        + (f" and {args.out / 'memory_phases.png'}" if drawn else " (pip install matplotlib for memory_phases.png)")
    )


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    train_data, val_data = load_splits(DATA)
    model = GPT(args.layers, args.dim, args.heads, args.seq)
    config = engine_config(args.deepspeed_config, args.out)
    args.deepspeed_config = None
    engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(), config=config)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # the per-phase lines are summarised at the end
    rank = deepspeed.comm.get_rank()
    if rank == 0:
        n = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
        print(
            f"GPT: {n / 1e6:.2f}M parameters, {args.layers} layers, dim {args.dim}, context {args.seq} bytes; "
            f"ZeRO stage {engine.zero_optimization_stage()} over {deepspeed.comm.get_world_size()} ranks"
        )
    val_batches = [sample(val_data, 16, args.seq, seed=10_000 + i) for i in range(4)]
    history = train(args, engine, train_data, val_batches)
    if rank == 0:
        report(args, engine, history)
    first, last = history[0]["val_loss"], history[-1]["val_loss"]
    engine.destroy()
    if not last < first:
        raise SystemExit(f"held-out loss did not fall: {first:.3f} -> {last:.3f}")


if __name__ == "__main__":
    main()
