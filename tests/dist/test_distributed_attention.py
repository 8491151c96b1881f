"""``deepspeed.sequence.layer.DistributedAttention`` at SP=2 against causal attention on the whole sequence.

Both ranks draw the same whole q, k, v; each feeds its half of the tokens to ``DistributedAttention`` around a
plain causal attention kernel. Its output and the gradients of its q, k, v shards must equal the matching slices
of the whole-sequence attention's output and gradients (the backward runs the exchanges in reverse), in both
layouts (batch first and sequence first) and with rotary position embeddings applied after the exchange.
"""

from __future__ import annotations

import pytest
import torch

from tests._harness import run_distributed

SEQ, BATCH, HEADS, DIM, SP = 8, 2, 4, 6, 2
CASES = [(0, False), (1, False), (1, True)]


def _attention(batch_dim: int):
    """Causal attention on ``[b, s, h, d]`` (batch_dim 0) or ``[s, b, h, d]`` (batch_dim 1)."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        to_bhsd = (0, 2, 1, 3) if batch_dim == 0 else (1, 2, 0, 3)
        out = torch.nn.functional.scaled_dot_product_attention(*(t.permute(to_bhsd) for t in (q, k, v)), is_causal=True)
        return out.permute(0, 2, 1, 3) if batch_dim == 0 else out.permute(2, 0, 1, 3)

    return attend


def _inputs(batch_dim: int) -> tuple:
    g = torch.Generator().manual_seed(batch_dim)
    shape = (BATCH, SEQ, HEADS, DIM) if batch_dim == 0 else (SEQ, BATCH, HEADS, DIM)
    q, k, v, weight = (torch.randn(shape, generator=g) for _ in range(4))
    angles = torch.randn(1, SEQ, 1, DIM, generator=g)  # [1, s, 1, d]: the layer swaps dims 0 and 1
    return q, k, v, weight, (angles.cos(), angles.sin())


def _rotate(t: torch.Tensor, rotary: tuple) -> torch.Tensor:
    cos, sin = (f.permute(1, 0, 2, 3) for f in rotary)
    half = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin


def _shard(t: torch.Tensor, batch_dim: int, rank: int) -> torch.Tensor:
    return t.chunk(SP, dim=1 - batch_dim)[rank]


def _sp_run() -> dict:
    import deepspeed.comm as dist
    from deepspeed.sequence.layer import DistributedAttention

    group = dist.new_group([0, 1])
    rank = dist.get_rank()
    out = {}
    for batch_dim, rotary in CASES:
        q, k, v, weight, freqs = _inputs(batch_dim)
        shards = [_shard(t, batch_dim, rank).clone().requires_grad_(True) for t in (q, k, v)]
        layer = DistributedAttention(_attention(batch_dim), group)
        result = layer(*shards, batch_dim, freqs if rotary else None)
        (result * _shard(weight, batch_dim, rank)).sum().backward()
        out[(batch_dim, rotary)] = {"out": result.detach(), "grads": [t.grad for t in shards]}
    return out


def _reference(batch_dim: int, rotary: bool) -> dict:
    q, k, v, weight, freqs = _inputs(batch_dim)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    qr, kr = (_rotate(t, freqs) for t in leaves[:2]) if rotary else leaves[:2]
    result = _attention(batch_dim)(qr, kr, leaves[2])
    (result * weight).sum().backward()
    return {"out": result.detach(), "grads": [t.grad for t in leaves]}


@pytest.fixture(scope="module")
def sp_results() -> list:
    return run_distributed(_sp_run, SP)


@pytest.mark.parametrize("batch_dim, rotary", CASES)
def test_distributed_attention_matches_whole_sequence(sp_results: list, batch_dim: int, rotary: bool) -> None:
    want = _reference(batch_dim, rotary)
    for rank, results in enumerate(sp_results):
        got = results[(batch_dim, rotary)]
        torch.testing.assert_close(got["out"], _shard(want["out"], batch_dim, rank), msg=f"rank {rank} output")
        for name, g, w in zip("qkv", got["grads"], want["grads"], strict=True):
            torch.testing.assert_close(g, _shard(w, batch_dim, rank), msg=f"rank {rank} grad {name}")


def _bad_heads(q_heads: int, kv_heads: int) -> str:
    import deepspeed.comm as dist
    from deepspeed.sequence.layer import DistributedAttention

    layer = DistributedAttention(_attention(1), dist.new_group([0, 1]))
    q = torch.zeros(SEQ // SP, BATCH, q_heads, DIM)
    kv = torch.zeros(SEQ // SP, BATCH, kv_heads, DIM)
    try:
        layer(q, kv, kv, 1)
    except ValueError as err:
        return str(err)
    raise AssertionError(f"{q_heads} query / {kv_heads} key/value heads over 2 ranks were accepted")


@pytest.mark.parametrize("q_heads, kv_heads", [(3, 3), (4, 1)])
def test_heads_not_divisible_by_sp_raise_on_every_rank(q_heads: int, kv_heads: int) -> None:
    # Upstream spreads uneven head counts unevenly; here they are refused before any exchange, naming the counts.
    for message in run_distributed(_bad_heads, SP, q_heads, kv_heads):
        for words in (f"query heads ({q_heads})", f"key/value heads ({kv_heads})", "sequence parallel size (2)"):
            assert words in message, message
