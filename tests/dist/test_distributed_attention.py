"""``deepspeed.sequence.layer.DistributedAttention`` at SP=2 against causal attention on the whole sequence.

Both ranks draw the same whole q, k, v; each feeds its half of the tokens to ``DistributedAttention`` around a
plain causal attention kernel. Its output and the gradients of its q, k, v shards must equal the matching slices
of the whole-sequence attention's output and gradients (the backward runs the exchanges in reverse), in both
layouts (batch first and sequence first) and with rotary position embeddings applied after the exchange.

Head counts the group size does not divide (3 and 5 heads at SP=2, 6 at SP=4, and grouped-query attention with
fewer key/value heads) must match the same way, with each rank holding the heads upstream gives it (the first
ranks take the extra head); the counts the local attention sees are checked against the expected split.
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
        # Grouped-query attention: query head i reads key/value head i // (query heads / key/value heads).
        k, v = (t.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for t in (k, v))
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


# (sp, query heads, key/value heads, batch_dim, rotary) -> the query and key/value heads each rank must hold.
UNEVEN = {
    (2, 3, 3, 0, False): ([2, 1], [2, 1]),
    (2, 5, 5, 1, True): ([3, 2], [3, 2]),
    (2, 6, 3, 1, False): ([4, 2], [2, 1]),  # each rank keeps the query heads of its key/value heads
    (4, 6, 6, 1, True): ([2, 2, 1, 1], [2, 2, 1, 1]),
    (4, 12, 6, 0, False): ([4, 4, 2, 2], [2, 2, 1, 1]),
}
REFUSED = {2: [(1, 1), (4, 1), (3, 2)], 4: [(3, 3), (6, 2)]}


def _uneven_inputs(case: tuple) -> tuple:
    _, heads, kv_heads, batch_dim, _ = case
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    lead = (BATCH, SEQ) if batch_dim == 0 else (SEQ, BATCH)
    q, weight = (torch.randn(*lead, heads, DIM, generator=g) for _ in range(2))
    k, v = (torch.randn(*lead, kv_heads, DIM, generator=g) for _ in range(2))
    angles = torch.randn(1, SEQ, 1, DIM, generator=g)
    return q, k, v, weight, (angles.cos(), angles.sin())


def _counting(attend, seen: list):
    def local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen.append((q.shape[2], k.shape[2]))
        return attend(q, k, v)

    return local


def _refused(group, sp: int, q_heads: int, kv_heads: int) -> str:
    from deepspeed.sequence.layer import DistributedAttention

    layer = DistributedAttention(_attention(1), group)
    q = torch.zeros(SEQ // sp, BATCH, q_heads, DIM)
    kv = torch.zeros(SEQ // sp, BATCH, kv_heads, DIM)
    try:
        layer(q, kv, kv, 1)
    except ValueError as err:
        return str(err)
    raise AssertionError(f"{q_heads} query / {kv_heads} key/value heads over {sp} ranks were accepted")


def _uneven_run(sp: int) -> dict:
    import deepspeed.comm as dist
    from deepspeed.sequence.layer import DistributedAttention

    group = dist.new_group(list(range(sp)))
    rank = dist.get_rank()
    out: dict = {"refused": {pair: _refused(group, sp, *pair) for pair in REFUSED[sp]}}
    for case in (c for c in UNEVEN if c[0] == sp):
        batch_dim, rotary = case[3], case[4]
        q, k, v, weight, freqs = _uneven_inputs(case)
        shards = [t.chunk(sp, dim=1 - batch_dim)[rank].clone().requires_grad_(True) for t in (q, k, v)]
        seen: list = []
        layer = DistributedAttention(_counting(_attention(batch_dim), seen), group)
        result = layer(*shards, batch_dim, freqs if rotary else None)
        (result * weight.chunk(sp, dim=1 - batch_dim)[rank]).sum().backward()
        out[case] = {"out": result.detach(), "grads": [t.grad for t in shards], "seen": seen}
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["sp2", "sp4"])
def uneven_results(request: pytest.FixtureRequest) -> tuple:
    return request.param, run_distributed(_uneven_run, request.param, request.param)


def _uneven_reference(case: tuple) -> dict:
    q, k, v, weight, freqs = _uneven_inputs(case)
    batch_dim, rotary = case[3], case[4]
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    qr, kr = (_rotate(t, freqs) for t in leaves[:2]) if rotary else leaves[:2]
    result = _attention(batch_dim)(qr, kr, leaves[2])
    (result * weight).sum().backward()
    return {"out": result.detach(), "grads": [t.grad for t in leaves]}


def test_uneven_heads_match_whole_sequence(uneven_results: tuple) -> None:
    sp, per_rank = uneven_results
    for case in (c for c in UNEVEN if c[0] == sp):
        want, (q_split, kv_split), seq_dim = _uneven_reference(case), UNEVEN[case], 1 - case[3]
        for rank, results in enumerate(per_rank):
            got = results[case]
            assert got["seen"] == [(q_split[rank], kv_split[rank])], (case, rank, got["seen"])
            label = f"{case} rank {rank}"
            torch.testing.assert_close(got["out"], want["out"].chunk(sp, dim=seq_dim)[rank], msg=f"{label} output")
            for name, g, w in zip("qkv", got["grads"], want["grads"], strict=True):
                torch.testing.assert_close(g, w.chunk(sp, dim=seq_dim)[rank], msg=f"{label} grad {name}")


def test_unsplittable_heads_raise_on_every_rank(uneven_results: tuple) -> None:
    # Fewer (key/value) heads than ranks, or query heads that are no multiple of the key/value heads.
    sp, per_rank = uneven_results
    for q_heads, kv_heads in REFUSED[sp]:
        expected = (f"query heads ({q_heads})", f"key/value heads ({kv_heads})", f"sequence parallel size ({sp})")
        for results in per_rank:
            message = results["refused"][(q_heads, kv_heads)]
            assert all(words in message for words in expected), message


def _standalone_round_trip() -> dict:
    import deepspeed.comm as dist
    from deepspeed.sequence.layer import _SeqAllToAll, single_all_to_all, uneven_heads_all2all

    group, rank = dist.new_group([0, 1]), dist.get_rank()
    whole = torch.randn(SEQ, BATCH, 3, DIM, generator=torch.Generator().manual_seed(7))
    weight = torch.randn(SEQ, BATCH, 3, DIM, generator=torch.Generator().manual_seed(8))
    mine = whole.chunk(SP, dim=0)[rank].clone().requires_grad_(True)
    heads = _SeqAllToAll.apply(group, mine, 2, 0, 1)  # all tokens, this rank's heads
    back = _SeqAllToAll.apply(group, heads, 0, 2, 1)
    (back * weight.chunk(SP, dim=0)[rank]).sum().backward()
    plain = [single_all_to_all(mine.detach(), 2, 0, 1, group), uneven_heads_all2all(heads.detach(), 0, 2, 1, group)]
    try:
        _SeqAllToAll.apply(group, torch.zeros(SEQ // SP, BATCH, 1, DIM), 2, 0, 1)
        refused = ""
    except ValueError as err:
        refused = str(err)
    try:
        single_all_to_all(mine.detach(), 2, 0, 1, group, async_op=True)
        refused_async = ""
    except ValueError as err:
        refused_async = str(err)
    return dict(
        heads=heads.detach(), back=back.detach(), grad=mine.grad, plain=plain, refused=refused, refused_async=refused_async
    )


def test_seq_all_to_all_spreads_uneven_heads_and_returns() -> None:
    whole = torch.randn(SEQ, BATCH, 3, DIM, generator=torch.Generator().manual_seed(7))
    weight = torch.randn(SEQ, BATCH, 3, DIM, generator=torch.Generator().manual_seed(8))
    for rank, got in enumerate(run_distributed(_standalone_round_trip, SP)):
        first, count = (0, 2) if rank == 0 else (2, 1)  # rank 0 takes the extra head
        assert torch.equal(got["heads"], whole[:, :, first : first + count]), rank
        assert torch.equal(got["back"], whole.chunk(SP, dim=0)[rank]), rank
        assert torch.equal(got["grad"], weight.chunk(SP, dim=0)[rank]), rank
        # Upstream's plain-function forms of the same exchanges.
        assert torch.equal(got["plain"][0], got["heads"]) and torch.equal(got["plain"][1], got["back"]), rank
        assert "async_op" in got["refused_async"], got["refused_async"]
        for words in ("attention heads (1)", "sequence parallel size (2)"):
            assert words in got["refused"], got["refused"]
