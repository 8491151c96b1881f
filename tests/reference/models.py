"""Small deterministic models and data shared by parity and memory tests."""

from __future__ import annotations

import torch
from torch import nn


class TinyMLP(nn.Module):
    """Embedding → two hidden layers → tied or untied head; returns the mean cross-entropy loss.

    Sizes are deliberately odd (not multiples of any world size) to exercise padding.
    """

    def __init__(self, vocab: int = 37, hidden: int = 23, tied: bool = False, frozen_first: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden + 1)
        self.fc2 = nn.Linear(2 * hidden + 1, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        if frozen_first:
            self.fc1.requires_grad_(False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.fc2(torch.relu(self.fc1(h)))
        logits = self.head(self.norm(h)).float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def make_model(seed: int = 0, **kwargs: object) -> TinyMLP:
    """A freshly initialised :class:`TinyMLP` whose weights depend only on ``seed``."""
    torch.manual_seed(seed)
    return TinyMLP(**kwargs)  # type: ignore[arg-type]


def micro_batch(
    step: int, index: int, micro: int = 3, seq: int = 5, vocab: int = 37
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``index``-th micro-batch of optimizer step ``step``: same on every rank that asks for it."""
    g = torch.Generator().manual_seed(1000 * step + index)
    tokens = torch.randint(0, vocab, (micro, seq), generator=g)
    labels = torch.randint(0, vocab, (micro, seq), generator=g)
    return tokens, labels
