"""GPT-style decoders for the benchmarks, built from a config with random weights (no downloads).

``gpt1.3b`` follows user report 1 (GPT-NeoX shapes: 24 layers, hidden 2048, 16 heads, sequence 2048, rotary
positions, untied output layer, GPT-NeoX vocabulary 50432); ``gpt2.6b`` is the 2-6 GB model of scenario S2;
``quick`` and ``quick-s2`` are tiny variants for CPU smoke tests. Every transformer block can be wrapped in
activation checkpointing (``torch.utils.checkpoint``, non-reentrant), as in the reports.

Parameters are created directly on the requested device and dtype (``device=``/``dtype=`` factory arguments), so
building a model never makes a transient fp32 or host copy that would pollute the memory measurements.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a decoder-only transformer."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int = 50432
    ffn_mult: int = 4
    checkpoint_layers: bool = True

    def num_params(self) -> int:
        """Trainable parameters, counted from the shapes (matches ``sum(p.numel())`` of the built model)."""
        h, f = self.hidden, self.ffn_mult * self.hidden
        block = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
        return self.vocab * h + self.layers * block + 2 * h + h * self.vocab

    def largest_layer_params(self) -> int:
        """Parameters of the largest single fetch unit (a block or the embedding / output layer)."""
        h, f = self.hidden, self.ffn_mult * self.hidden
        block = 4 * h + 3 * h * h + 3 * h + h * h + h + 2 * h * f + f + h
        return max(block, self.vocab * h)

    def to_dict(self) -> dict:
        """Plain dict (for result records)."""
        return asdict(self)


MODELS: dict[str, GPTConfig] = {
    "gpt1.3b": GPTConfig(layers=24, hidden=2048, heads=16, seq=2048),
    "gpt2.6b": GPTConfig(layers=30, hidden=2560, heads=20, seq=2048),
    "quick": GPTConfig(layers=2, hidden=64, heads=4, seq=32, vocab=256),
    "quick-s2": GPTConfig(layers=4, hidden=128, heads=4, seq=32, vocab=512),
}


def _rotary_tables(seq: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [b, heads, s, d]; rotate pairs (even, odd) by the position angle.
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention with rotary positions, then a GELU MLP."""

    def __init__(self, cfg: GPTConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        h, f = cfg.hidden, cfg.ffn_mult * cfg.hidden
        kw = {"device": device, "dtype": dtype}
        self.heads = cfg.heads
        self.checkpointed = cfg.checkpoint_layers
        self.ln1 = nn.LayerNorm(h, **kw)
        self.qkv = nn.Linear(h, 3 * h, **kw)
        self.proj = nn.Linear(h, h, **kw)
        self.ln2 = nn.LayerNorm(h, **kw)
        self.fc1 = nn.Linear(h, f, **kw)
        self.fc2 = nn.Linear(f, h, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The block, under activation checkpointing when configured and gradients are on.

        The checkpoint sits inside the module's own forward, so hooks installed on the block (FSDP2's unshard and
        input cast) run outside the recomputed region, as in the usual FSDP2 recipe; for ZeRO-1/2 (no module
        hooks) this is the same as checkpointing the block from outside.
        """
        if self.checkpointed and torch.is_grad_enabled():
            return checkpoint(self._body, x, cos, sin, use_reentrant=False)
        return self._body(x, cos, sin)

    def _body(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only LM with an untied output layer; ``forward(ids, labels)`` returns the mean token loss."""

    def __init__(self, cfg: GPTConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        kw = {"device": device, "dtype": dtype}
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden, **kw)
        self.layers = nn.ModuleList(Block(cfg, device, dtype) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden, **kw)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False, **kw)
        cos, sin = _rotary_tables(cfg.seq, cfg.hidden // cfg.heads, device)
        self.register_buffer("rot_cos", cos, persistent=False)
        self.register_buffer("rot_sin", sin, persistent=False)
        with torch.no_grad():  # small init keeps fp16 activations and losses finite
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.02 / (math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "fc2.weight")) else 1))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of next-token prediction (computed in fp32)."""
        x = self.embed(ids)
        s = ids.shape[1]
        cos, sin = self.rot_cos[:s], self.rot_sin[:s]
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def build_model(name: str, device: torch.device, dtype: torch.dtype) -> GPT:
    """Build model ``name`` (a key of :data:`MODELS`) with random weights on ``device`` in ``dtype``."""
    torch.manual_seed(1234)
    return GPT(MODELS[name], device, dtype)


def random_batch(cfg: GPTConfig, micro_batch: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and their next-token labels for one micro-batch."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, cfg.vocab, (micro_batch, cfg.seq + 1), generator=gen)
    return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)
