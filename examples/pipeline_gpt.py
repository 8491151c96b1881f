"""Pipeline-parallel training of a GPT-NeoX-shaped model built from ``LayerSpec``s.

    deepspeed --num_gpus 2 examples/pipeline_gpt.py --deepspeed_config examples/ds_config_pipeline_neox.json --gas 4

The model is the GPT-NeoX layout: token embedding, ``--layers`` transformer layers (pre-norm, attention and MLP
in parallel on the residual, rotary positions on a quarter of each head), a final LayerNorm and an untied output
projection. ``PipelineModule`` builds on each rank only the layers of its stage (partitioned so that every stage
gets the same number of transformer layers) and checkpoints activations every layer. The config is the GPT-NeoX
run of the memory report: ZeRO-1, fp16 with dynamic loss scaling, partitioned activation checkpointing, clipping
1.0, Adam (lr 2e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1), micro-batch 1; the number of micro-batches per
step comes from ``--gas``. Defaults are small enough for two CPU processes (the launcher starts CPU processes on a
machine without GPUs).

The script prints the loss on rank 0 and exits non-zero when training did not reduce it. ``--save_dir`` writes a
checkpoint at the end (per-layer files, one model-states file per stage, ZeRO-1 shards).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import deepspeed


class EmbeddingPipe(nn.Module):
    """Token ids ``[batch, seq]`` to hidden states ``[batch, seq, hidden]``."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(tokens)


def rotary_tables(seq: int, dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[seq, dim]`` for rotary positions over ``dim`` channels."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x`` ``[batch, heads, seq, head_dim]``; keep the rest."""
    rot, keep = x[..., : cos.shape[-1]], x[..., cos.shape[-1] :]
    half = rot.shape[-1] // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, keep], dim=-1)


class TransformerLayerPipe(nn.Module):
    """A GPT-NeoX layer: ``x + attention(ln1(x)) + mlp(ln2(x))`` with causal attention and rotary positions."""

    def __init__(self, hidden: int, heads: int, seq: int, rotary_pct: float = 0.25) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
        self.heads, self.head_dim = heads, hidden // heads
        self.input_layernorm = nn.LayerNorm(hidden)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.query_key_value = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.dense_h_to_4h = nn.Linear(hidden, 4 * hidden)
        self.dense_4h_to_h = nn.Linear(4 * hidden, hidden)
        rotary_dim = max(2, int(self.head_dim * rotary_pct) // 2 * 2)
        cos, sin = rotary_tables(seq, rotary_dim)
        # Recomputed from the sizes on every rank, so not part of the checkpoint.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """Causal self-attention of ``x`` ``[batch, seq, hidden]``."""
        b, s, h = x.shape
        qkv = self.query_key_value(x).view(b, s, self.heads, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.split(self.head_dim, dim=-1)
        cos, sin = self.cos[:s].to(q.dtype), self.sin[:s].to(q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(b, s, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.dense_4h_to_h(nn.functional.gelu(self.dense_h_to_4h(self.post_attention_layernorm(x))))
        return x + self.attention(self.input_layernorm(x)) + mlp


class NormPipe(nn.Module):
    """The final LayerNorm."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class HeadPipe(nn.Module):
    """The untied output projection to vocabulary logits."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.final_linear = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_linear(x)


def gpt_neox_layers(vocab: int, hidden: int, heads: int, layers: int, seq: int) -> list[Any]:
    """The model as a pipeline layer list (nothing is built here)."""
    from deepspeed.pipe import LayerSpec

    return (
        [LayerSpec(EmbeddingPipe, vocab, hidden)]
        + [LayerSpec(TransformerLayerPipe, hidden, heads, seq) for _ in range(layers)]
        + [LayerSpec(NormPipe, hidden), LayerSpec(HeadPipe, hidden, vocab)]
    )


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, computed in fp32."""
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def synthetic_batches(vocab: int, seq: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless learnable micro-batches: sequences that count up by a fixed stride modulo the vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, vocab, (1, 1), generator=gen)
        tokens = (start + 3 * torch.arange(seq + 1)) % vocab
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gas", type=int, default=4, help="gradient_accumulation_steps (micro-batches per step)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pipe-parallel-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=97)
    parser.add_argument("--lr", type=float, default=None, help="override the config's learning rate")
    parser.add_argument("--save_dir", type=str, default=None, help="write a checkpoint here at the end")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def load_config(args: argparse.Namespace) -> dict:
    """The JSON config with the step's micro-batch count from ``--gas``."""
    if not args.deepspeed_config:
        raise SystemExit("pass --deepspeed_config examples/ds_config_pipeline_neox.json")
    with open(args.deepspeed_config, encoding="utf-8") as f:
        config = json.load(f)
    config.pop("train_batch_size", None)
    config["gradient_accumulation_steps"] = args.gas
    if args.lr is not None:
        config["optimizer"]["params"]["lr"] = args.lr
    return config


def main(argv: list[str] | None = None) -> int:
    from deepspeed.pipe import PipelineModule

    args = parse_args(argv)
    config = load_config(args)
    deepspeed.init_distributed()
    module = PipelineModule(
        gpt_neox_layers(args.vocab, args.hidden, args.heads, args.layers, args.seq),
        num_stages=args.pipe_parallel_size,
        loss_fn=lm_loss,
        seed_layers=True,
        partition_method="type:TransformerLayerPipe",
        activation_checkpoint_interval=1,
    )
    # Megatron/NeoX style: activation checkpointing configured with the pipeline grid as the mpu.
    deepspeed.checkpointing.configure(module.mpu(), deepspeed_config=config)
    engine, _, _, _ = deepspeed.initialize(
        model=module, model_parameters=[p for p in module.parameters() if p.requires_grad], config=config
    )
    grid = module.mpu()
    data = synthetic_batches(args.vocab, args.seq, seed=grid.get_data_parallel_rank())
    losses = []
    for step in range(args.steps):
        loss = float(engine.train_batch(data_iter=data))
        losses.append(loss)
        if deepspeed.comm.get_rank() == 0 and (step % 5 == 0 or step == args.steps - 1):
            deepspeed.logger.info(
                f"step {step}: loss {loss:.4f} (stage {module.stage_id}/{module.num_stages}, layers {module.parts})"
            )
    if args.save_dir:
        engine.save_checkpoint(args.save_dir)
    first, last = losses[0], sum(losses[-3:]) / len(losses[-3:])
    if deepspeed.comm.get_rank() == 0:
        deepspeed.logger.info(f"first loss {first:.4f}, final loss {last:.4f}")
    return 0 if math.isfinite(last) and last < first else 1


if __name__ == "__main__":
    sys.exit(main())
