"""Decoders for the benchmarks, built from a config with random weights (no downloads, no transformers).

GPT-style (:class:`GPTConfig`): ``gpt1.3b`` has GPT-NeoX shapes (24 layers, hidden 2048, 16
heads, sequence 2048, rotary positions, untied output layer, GPT-NeoX vocabulary 50432); ``gpt2.6b`` is the 2-6 GB
model of scenario S2; ``quick`` and ``quick-s2`` are tiny variants for CPU smoke tests.

Qwen2-shaped (:class:`QwenConfig`, scenario S3): RMSNorm, rotary positions (half-split rotation,
base 1e6), grouped-query attention (``kv_heads`` key/value heads), q/k/v projections with bias, output projection
without, SwiGLU MLP (gate/up/down, no bias), tied or untied embeddings. ``qwen2-3b`` (hidden 2048, 36 layers, 16
heads, 2 kv heads, intermediate 11008, vocab 151936, tied: 3.09 B parameters) and ``qwen2.5-7b`` (hidden 3584,
28 layers, 28 heads, 4 kv heads, intermediate 18944, vocab 152064, untied: 7.62 B) at sequence 512;
``quick-qwen`` is a tiny variant for CPU. Only the shapes follow those models; the weights are random.

Every decoder layer can be wrapped in activation checkpointing (``torch.utils.checkpoint``, non-reentrant), as
in the reports, from inside the layer's own ``forward`` (so module hooks, FSDP2's and ZeRO-3's, stay outside the
recomputed region).

Parameters are created directly on the requested device and dtype (``device=``/``dtype=`` factory arguments), so
building a model never makes a transient fp32 or host copy that would pollute the memory measurements.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

CHECKPOINT_USE_REENTRANT = False
"""Set by a worker (spec ``checkpoint_reentrant``): upstream ZeRO-3 fails under the non-reentrant form on the H200
image (its recompute sees released, size-0 weights), so its S3 rows use the reentrant one, as HF models did."""


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


@dataclass(frozen=True)
class QwenConfig:
    """Shape of a Qwen2-style decoder (see the module docstring)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    seq: int = 512
    tied: bool = True
    rope_base: float = 1e6
    norm_eps: float = 1e-6
    checkpoint_layers: bool = True
    family: str = "qwen2"
    tile_mlp: int = 0  # > 0: every MLP runs under ``TiledMLP`` with this many row tiles
    tile_loss: int = 0  # > 0: head + cross-entropy run under ``TiledFusedLogitsLoss`` with this many tiles

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads

    def layer_params(self) -> int:
        """Parameters of one decoder layer (two norms, attention with q/k/v bias, SwiGLU MLP)."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attn = (h * h + h) + 2 * (h * kv + kv) + h * h
        return 2 * h + attn + 3 * h * self.intermediate

    def num_params(self) -> int:
        """Trainable parameters, counted from the shapes (a tied head shares the embedding's)."""
        head = 0 if self.tied else self.vocab * self.hidden
        return self.vocab * self.hidden + self.layers * self.layer_params() + self.hidden + head

    def largest_layer_params(self) -> int:
        """Parameters of the largest single fetch unit (a decoder layer or the embedding)."""
        return max(self.layer_params(), self.vocab * self.hidden)

    def to_dict(self) -> dict:
        """Plain dict (for result records)."""
        return asdict(self)


ModelConfig = GPTConfig | QwenConfig

MODELS: dict[str, ModelConfig] = {
    "gpt1.3b": GPTConfig(layers=24, hidden=2048, heads=16, seq=2048),
    "gpt2.6b": GPTConfig(layers=30, hidden=2560, heads=20, seq=2048),
    "quick": GPTConfig(layers=2, hidden=64, heads=4, seq=32, vocab=256),
    "quick-s2": GPTConfig(layers=4, hidden=128, heads=4, seq=32, vocab=512),
    "qwen2-3b": QwenConfig(layers=36, hidden=2048, heads=16, kv_heads=2, intermediate=11008, vocab=151936),
    "qwen2.5-7b": QwenConfig(
        layers=28, hidden=3584, heads=28, kv_heads=4, intermediate=18944, vocab=152064, tied=False
    ),
    "quick-qwen": QwenConfig(layers=4, hidden=64, heads=4, kv_heads=2, intermediate=160, vocab=256, seq=32),
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
            return checkpoint(self._body, x, cos, sin, use_reentrant=CHECKPOINT_USE_REENTRANT)
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
                    p.normal_(
                        0.0, 0.02 / (math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "fc2.weight")) else 1)
                    )

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of next-token prediction (computed in fp32)."""
        x = self.embed(ids)
        s = ids.shape[1]
        cos, sin = self.rot_cos[:s], self.rot_sin[:s]
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


# ----------------------------------------------------------------------------------------------- Qwen2-shaped
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def qwen_rotary(seq: int, head_dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[seq, head_dim]`` for half-split rotary embeddings (fp32, computed per forward)."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (statistics in fp32)."""

    def __init__(self, hidden: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x / rms(x) * weight``."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class QwenAttention(nn.Module):
    """Causal grouped-query self-attention: q/k/v with bias, output projection without."""

    def __init__(self, cfg: QwenConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=True, **kw)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=True, **kw)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=True, **kw)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention output ``[b, s, hidden]``."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        groups = self.heads // self.kv_heads
        if groups > 1:  # every query head of a group reads the same key/value head
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(att.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class QwenMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, cfg: QwenConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype, "bias": False}
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, **kw)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, **kw)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, **kw)

        self.tiles = cfg.tile_mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP output (tile by tile along the sequence when ``tile_mlp`` is set)."""
        if self.tiles and torch.is_grad_enabled():
            # Imported here so that whichever ``deepspeed`` is on the path (ours or upstream) provides it.
            from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

            return TiledMLP.apply(QwenMLP._dense, self, x, self.tiles, list(self.parameters()))
        return self._dense(x)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QwenDecoderLayer(nn.Module):
    """Pre-norm decoder layer (attention, then MLP), checkpointed from inside ``forward`` like :class:`Block`."""

    def __init__(self, cfg: QwenConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.checkpointed = cfg.checkpoint_layers
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.norm_eps, device, dtype)
        self.self_attn = QwenAttention(cfg, device, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.norm_eps, device, dtype)
        self.mlp = QwenMLP(cfg, device, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The layer, under activation checkpointing when configured and gradients are on."""
        if self.checkpointed and torch.is_grad_enabled():
            return checkpoint(self._body, x, cos, sin, use_reentrant=CHECKPOINT_USE_REENTRANT)
        return self._body(x, cos, sin)

    def _body(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class QwenLM(nn.Module):
    """Qwen2-shaped causal LM; ``forward(ids, labels)`` returns the mean token loss (computed in fp32).

    A tied head is an ``nn.Linear`` whose weight *is* the embedding's parameter (the usual way), so ZeRO-3 fetches
    it with the head module. Works inside ``deepspeed.zero.Init`` (ours and upstream): parameters already
    partitioned at construction keep the modules' default initialisation (their values do not matter for memory).
    """

    def __init__(self, cfg: QwenConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        kw = {"device": device, "dtype": dtype}
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden, **kw)
        self.layers = nn.ModuleList(QwenDecoderLayer(cfg, device, dtype) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps, device, dtype)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False, **kw)
        if cfg.tied:
            self.lm_head.weight = self.embed_tokens.weight
        with torch.no_grad():  # small init keeps logits and losses moderate; skipped for partitioned params
            for name, p in self.named_parameters():
                if p.dim() == 2 and not hasattr(p, "ds_id") and p.numel():
                    scaled = name.endswith(("o_proj.weight", "down_proj.weight"))
                    p.normal_(0.0, 0.02 / (math.sqrt(2 * cfg.layers) if scaled else 1))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of next-token prediction."""
        x = self.embed_tokens(ids)
        cos, sin = qwen_rotary(ids.shape[1], self.cfg.head_dim, self.cfg.rope_base, ids.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        hidden = self.norm(x)
        if self.cfg.tile_loss and torch.is_grad_enabled():
            from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

            params = list(self.lm_head.parameters())
            return TiledFusedLogitsLoss.apply(
                QwenLM._head_loss, self, hidden, labels, None, self.cfg.tile_loss, params, "mean"
            )
        return self._head_loss(hidden, labels)

    def _head_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def with_seq(name: str, seq: int | str | None = None) -> str:
    """The model key for ``name`` at sequence length ``seq``: ``name`` itself when ``seq`` is ``None`` or its own,
    else ``<name>@seq<seq>``, registered in :data:`MODELS` as the same shape with that sequence length."""
    if seq is None or int(seq) == MODELS[name].seq:
        return name
    derived = f"{name}@seq{int(seq)}"
    MODELS[derived] = dataclasses.replace(MODELS[name], seq=int(seq))
    return derived


def with_tiles(name: str, tile_mlp: int = 0, tile_loss: int = 0) -> str:
    """The model key for ``name`` with tiled MLP / tiled logits+loss (``0`` = untiled), registered like
    :func:`with_seq`."""
    if not (tile_mlp or tile_loss):
        return name
    derived = f"{name}@mlp{int(tile_mlp)}loss{int(tile_loss)}"
    MODELS[derived] = dataclasses.replace(MODELS[name], tile_mlp=int(tile_mlp), tile_loss=int(tile_loss))
    return derived


def build_model(name: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Build model ``name`` (a key of :data:`MODELS`) with random weights on ``device`` in ``dtype``.

    May be called inside ``deepspeed.zero.Init`` (then each module's parameters are partitioned as it is built).
    """
    torch.manual_seed(1234)
    cfg = MODELS[name]
    if isinstance(cfg, QwenConfig):
        return QwenLM(cfg, device, dtype)
    return GPT(cfg, device, dtype)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers of a benchmark model (the FSDP2 units, the S3 "gathered layer" units)."""
    return list(model.layers)


def random_batch(
    cfg: ModelConfig, micro_batch: int, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and their next-token labels for one micro-batch."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, cfg.vocab, (micro_batch, cfg.seq + 1), generator=gen)
    return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)
