"""Train a small byte-level GPT on a public-domain text with ZeRO-3 and report loss and memory.

    deepspeed --num_gpus 2 examples/train_gpt.py --deepspeed_config examples/ds_config_gpt_zero3.json

The text is the Jargon File excerpt in ``examples/data/`` (public domain, see its README): the first 90 % of its
bytes train, the last 10 % are held out. Tokens are bytes (vocabulary 256), so nothing is downloaded. Every
``--eval_every`` steps rank 0 prints the train loss and the held-out loss; at the end the script prints the memory
of each phase (after forward / backward / step) next to the model-state floor of this ZeRO stage, and writes into
``--out``: ``metrics.json`` (losses, memory records), ``memory_phases.png`` (with matplotlib) and, on CUDA, the
engine's allocator timeline of one step (``memory_timeline_rank<r>.png/.json/.pickle``). On a machine without GPUs
the launcher starts CPU processes (gloo); with no device allocator to ask, "memory" is then the tensor storages the
engine holds (parameters, gradients, optimizer states, its buffers), and the plot says so.

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
    probe: MemoryProbe,
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
            probe.mark("after forward", step)
            engine.backward(loss)
            probe.mark("after backward", step)
            engine.step()
            probe.mark("after step", step)
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


def held_tensor_bytes(root: object, depth: int = 8) -> int:
    """Bytes of the distinct tensor storages reachable from ``root`` through attributes, lists and dicts.

    Used on CPU, where there is no device allocator to ask: walking the engine finds the parameters, gradients,
    optimizer states and the buffers the engine keeps, each storage counted once. Activations are not held by
    the engine between phases and are not counted.
    """
    seen_objects: set[int] = set()
    storages: dict[int, int] = {}
    frontier: list[tuple[object, int]] = [(root, 0)]
    while frontier:
        obj, level = frontier.pop()
        if id(obj) in seen_objects or level > depth:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            frontier.extend((t, level + 1) for t in (getattr(obj, "grad", None), getattr(obj, "ds_tensor", None)))
            continue
        if isinstance(obj, dict):
            children = list(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            children = list(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            children = list(vars(obj).values())
        else:
            continue
        frontier.extend((c, level + 1) for c in children)
    return sum(storages.values())


class MemoryProbe:
    """The memory figure at each phase of training, in GiB, with a statement of what it measures.

    On a GPU: the bytes the device allocator has handed to tensors. On a CPU: the tensor storages the engine holds
    (see :func:`held_tensor_bytes`), the quantity the model-state floor bounds from below.
    """

    def __init__(self, engine: deepspeed.DeepSpeedEngine) -> None:
        self.engine = engine
        self.on_gpu = get_accelerator().device_name() != "cpu"
        self.what = "device memory allocated to tensors" if self.on_gpu else "tensors held by the engine"
        self.records: list[dict] = []

    def mark(self, phase: str, step: int) -> None:
        """Record the figure after ``phase`` of optimizer step ``step``."""
        used = get_accelerator().memory_allocated() if self.on_gpu else held_tensor_bytes(self.engine)
        self.records.append({"phase": phase, "step": step, "gib": used / 2**30})


def memory_summary(records: list[dict], floor_gib: float) -> dict[str, dict[str, float]]:
    """Per phase: the largest figure over the run, next to the model-state floor."""
    phases: dict[str, dict[str, float]] = {}
    for r in records:
        p = phases.setdefault(r["phase"], {"largest_gib": 0.0, "floor_gib": floor_gib})
        p["largest_gib"] = max(p["largest_gib"], r["gib"])
    return phases


def plot_run(probe: MemoryProbe, floor_gib: float, history: list[dict], png: Path, title: str) -> bool:
    """Memory per phase against the floor (left) and the loss curves (right); False without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(13, 4.8))
    FigureCanvasAgg(fig)
    mem, loss = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    for phase, marker in (("after forward", "o"), ("after backward", "s"), ("after step", "^")):
        points = [r for r in probe.records if r["phase"] == phase]
        mem.plot(
            [r["step"] for r in points],
            [r["gib"] for r in points],
            marker=marker,
            markersize=2.5,
            linewidth=0.8,
            label=phase,
        )
    mem.axhline(floor_gib, color="black", linestyle="--", label="model-state floor (this rank)")
    mem.set(xlabel="optimizer step", ylabel="GiB", title=f"memory: {probe.what} (rank 0)")
    mem.set_ylim(bottom=0)
    mem.legend(fontsize=8)
    trained = [h for h in history if "train_loss" in h]
    loss.plot([h["step"] for h in trained], [h["train_loss"] for h in trained], marker="o", label="train (last batch)")
    loss.plot([h["step"] for h in history], [h["val_loss"] for h in history], marker="s", label="held-out")
    loss.set(xlabel="optimizer step", ylabel="cross-entropy (nats per byte)", title="loss")
    loss.legend(fontsize=8)
    fig.suptitle(title)
    fig.text(
        0.01,
        -0.05,
        "Model-state floor: the bytes this rank's share of the parameters, gradients and optimizer states must take "
        "at this ZeRO stage (docs/memory_floors.md).\n"
        + (
            "On a GPU the figure is what the caching allocator has handed to tensors; the gap above the floor is "
            "activations and communication buffers."
            if probe.on_gpu
            else "On a CPU there is no device allocator: the figure is the tensor storages reachable from the engine "
            "(each counted once); activations live in the autograd graph and are not counted. After the step the "
            "gradients are released, so the figure drops below the floor, which counts them."
        ),
        fontsize=8,
    )
    fig.savefig(png, dpi=110, bbox_inches="tight")
    return True


def report(
    args: argparse.Namespace, engine: deepspeed.DeepSpeedEngine, probe: MemoryProbe, history: list[dict], title: str
) -> None:
    """Rank 0 prints the memory table and writes metrics.json and the PNG."""
    floor_gib = engine._loop.memory.floor.device / 2**30  # the engine's own floor for this stage and world
    args.out.mkdir(parents=True, exist_ok=True)
    summary = memory_summary(probe.records, floor_gib)
    print(f"memory per phase ({probe.what}, rank 0, largest over the run):")
    for phase, m in summary.items():
        print(f"  {phase:<15} {m['largest_gib']:8.4f} GiB; model-state floor {m['floor_gib']:.4f} GiB")
    metrics = {"history": history, "memory_per_phase": summary, "memory_measure": probe.what, "records": probe.records}
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    drawn = plot_run(probe, floor_gib, history, args.out / "memory_phases.png", title)
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
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    n = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    ranks = f"{world} GPU(s)" if get_accelerator().device_name() != "cpu" else f"{world} CPU process(es)"
    title = f"byte-level GPT, {n / 1e6:.1f}M parameters, ZeRO stage {engine.zero_optimization_stage()} over {ranks}"
    if rank == 0:
        print(f"{title}; {args.layers} layers, dim {args.dim}, context {args.seq} bytes")
    val_batches = [sample(val_data, 16, args.seq, seed=10_000 + i) for i in range(4)]
    probe = MemoryProbe(engine)
    history = train(args, engine, probe, train_data, val_batches)
    if rank == 0:
        report(args, engine, probe, history, title)
    first, last = history[0]["val_loss"], history[-1]["val_loss"]
    engine.destroy()
    if not last < first:
        raise SystemExit(f"held-out loss did not fall: {first:.3f} -> {last:.3f}")


if __name__ == "__main__":
    main()
