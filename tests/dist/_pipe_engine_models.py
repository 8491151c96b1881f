"""Shared pieces of the pipeline-engine tests: a small layer list, its single-process reference, the data.

The layer list is built by ``PipelineModule`` (only the local stage's layers, each seeded with
``base_seed + index``) and by :class:`SequentialReference` (every layer, seeded the same way), so both start
from identical weights. Micro-batch ``m`` of step ``s`` on data-parallel rank ``r`` is
``micro_batch(s, m * dp + r)``, the order the reference loop (``tests.reference.zero_oracle``) consumes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tests.reference.models import micro_batch

VOCAB, HIDDEN, BASE_SEED = 37, 23, 1234


class Block(nn.Module):
    """A residual MLP block (odd sizes, to exercise ZeRO padding)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 2 * hidden + 1)
        self.fc2 = nn.Linear(2 * hidden + 1, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.relu(self.fc1(h)))


class Head(nn.Module):
    """Norm and output projection."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.proj = nn.Linear(hidden, vocab, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(h))


class Scale(nn.Module):
    """Multiplies by a factor the test can change (forces an fp16 overflow on the stage that holds it)."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.factor


def tied_head(embedding: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    """Output projection through the tied embedding table."""
    return h @ embedding.weight.t()


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position, in fp32."""
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def layer_specs(tied: bool = False, blocks: int = 4, scale: bool = False) -> list[Any]:
    """The model as a pipeline layer list (embedding, ``blocks`` blocks, head)."""
    from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec

    first = TiedLayerSpec("embed", nn.Embedding, VOCAB, HIDDEN) if tied else LayerSpec(nn.Embedding, VOCAB, HIDDEN)
    layers: list[Any] = [first] + [LayerSpec(Block, HIDDEN) for _ in range(blocks)]
    if scale:
        layers.append(LayerSpec(Scale))
    if tied:
        layers += [
            LayerSpec(nn.LayerNorm, HIDDEN),
            TiedLayerSpec("embed", nn.Embedding, VOCAB, HIDDEN, forward_fn=tied_head),
        ]
    else:
        layers.append(LayerSpec(Head, HIDDEN, VOCAB))
    return layers


class SequentialReference(nn.Module):
    """Every layer of :func:`layer_specs` in one process; ``forward(tokens, labels)`` returns the loss."""

    def __init__(self, specs: list[Any]) -> None:
        super().__init__()
        from deepspeed.runtime.pipe.module import TiedLayerSpec

        self.layers = nn.ModuleList()
        self.tied = nn.ModuleDict()
        self.funcs: list[Any] = []
        self.names: list[str] = []
        for idx, spec in enumerate(specs):
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied:
                    torch.manual_seed(BASE_SEED + idx)
                    self.tied[spec.key] = spec.build()
                module = self.tied[spec.key]
                self.funcs.append(
                    module if spec.forward_fn is None else (lambda h, m=module, f=spec.forward_fn: f(m, h))
                )
                self.layers.append(nn.Identity())
            else:
                torch.manual_seed(BASE_SEED + idx)
                module = spec.build()
                self.layers.append(module)
                self.funcs.append(module)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h: Any = tokens
        for f in self.funcs:
            h = f(h)
        return loss_fn(h, labels)


def reference_name(stage_name: str) -> str:
    """The reference's parameter name for a ``PipelineModule`` parameter name."""
    if stage_name.startswith("tied_modules."):
        return "tied." + stage_name[len("tied_modules.") :]
    return "layers." + stage_name


def data_iter(
    steps: int, gas: int, dp: int, dp_rank: int, start: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches one data-parallel rank feeds over ``steps`` global batches."""
    for step in range(start, start + steps):
        for m in range(gas):
            yield micro_batch(step, m * dp + dp_rank)


def pipe_config(gas: int, clip: float = 0.5, stage: int = 0, dp: int = 1, **extra: Any) -> dict:
    """An engine config for the tests (AdamW, micro-batch 3)."""
    zero = {"stage": stage, **extra.pop("zero", {})}
    return {
        "train_batch_size": 3 * gas * dp,
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        **extra,
    }
