"""A small training script that runs unchanged under upstream DeepSpeed and deepspeed-lean.

    deepspeed --num_gpus 2 examples/train_tiny.py --deepspeed_config examples/ds_config_zero0.json

On a machine without GPUs the launcher starts CPU processes over gloo. The script prints the loss of
the first and last step on rank 0 and exits non-zero if training did not reduce the loss.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import deepspeed


class TinyLM(nn.Module):
    """A two-block MLP language model over a 64-token vocabulary."""

    def __init__(self, vocab: int = 64, hidden: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
            for _ in range(layers)
        )
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(h[:, :-1]).float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def batch(step: int, rank: int, micro: int, seq: int = 16) -> torch.Tensor:
    """A learnable toy task: each sequence counts up modulo the vocabulary from a random start."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    start = torch.randint(0, 64, (micro, 1), generator=g)
    return (start + torch.arange(seq)) % 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=30)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(0)
    engine, _, _, _ = deepspeed.initialize(args=args, model=TinyLM())
    rank = deepspeed.comm.get_rank()
    losses = []
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            tokens = batch(step, rank, engine.train_micro_batch_size_per_gpu()).to(engine.device)
            loss = engine(tokens)
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    if rank == 0:
        print(f"first loss {losses[0]:.4f} last loss {losses[-1]:.4f} steps {engine.global_steps}")
    if not losses[-1] < losses[0]:
        raise SystemExit("loss did not decrease")


if __name__ == "__main__":
    main()
