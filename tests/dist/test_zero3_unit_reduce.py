"""ZeRO-3 gradients reduced per fetch unit (``lean_unit_grad_reduce``) at world sizes 1, 2 and 4.

With the switch on, a bucket closes when a unit's backward is done, so no bucket mixes two blocks' gradients and
there are fewer collectives than with ``reduce_bucket_size`` buckets; each block's reduced row folds into the
gradient shard as one piece. The weights match the single-process reference either way (tied embeddings, a block
called twice, a frozen parameter, accumulation, clipping) and, at two ranks, match each other bit for bit. One
rank reduces nothing, so the switch changes nothing there.
"""

from __future__ import annotations

import pytest
import torch

from tests._harness import run_distributed
from tests.dist.test_zero3_block_units import GAS, STEPS, _config, _make, reference_weights
from tests.reference.models import micro_batch
from tests.reference.zero_oracle import engine_micro_index


def _block_of(name: str) -> str | None:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else None


def _train(world: int, unit_reduce: bool) -> dict:
    import deepspeed
    from deepspeed import comm as dist

    cfg = _config(True)
    cfg["zero_optimization"]["lean_unit_grad_reduce"] = unit_reduce
    engine, *_ = deepspeed.initialize(model=_make(), config=cfg)
    names = {p.ds_id: n for n, p in engine.module.named_parameters()}
    reducer = engine.optimizer.reducer
    io = reducer.io
    buckets: list[list[str]] = []  # the parameters of every bucket started, in order
    runs: list[int] = []  # per delivered bucket: the pieces it folds
    wire, deliver = io.wire, io.deliver

    def recording_wire(bucket):
        buckets.append([names[e.state.ds_id] for e in bucket.entries])
        return wire(bucket)

    def counting_deliver(bucket, kept):
        runs.append(len(bucket.targets))
        deliver(bucket, kept)

    io.wire, io.deliver = recording_wire, counting_deliver
    backwards = 0
    for step in range(STEPS):
        for m in range(GAS):
            engine.backward(engine(*micro_batch(step, engine_micro_index(m, dist.get_rank(), world))))
            backwards += 1
            engine.step()
    obj = [engine._zero3_consolidated_16bit_state_dict()]
    dist.broadcast_object_list(obj, src=0)
    out = {
        "unit_buckets": reducer.config.unit_buckets,
        "contiguous": io.contiguous_folds,
        "buckets_per_backward": len(buckets) / backwards,
        "mixed": [b for b in buckets if len({_block_of(n) for n in b} - {None}) > 1],
        "delivered_all": len(runs) == len(buckets),
        "block_runs": [r for b, r in zip(buckets, runs, strict=False) if all(_block_of(n) for n in b)],
        "weights": {k: v.float().clone() for k, v in obj[0].items()},
    }
    engine.destroy()
    return out


def _run_both(world: int) -> dict:
    return {unit_reduce: _train(world, unit_reduce) for unit_reduce in (True, False)}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_unit_buckets_match_the_reference_with_fewer_collectives(world: int) -> None:
    results = run_distributed(_run_both, world, world)
    ref = reference_weights(world)
    for rank_result in results:
        on, off = rank_result[True], rank_result[False]
        for case, got in (("on", on["weights"]), ("off", off["weights"])):
            for k, v in ref.items():
                torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k, c=case: f"{c}/{k}: {m}")
        assert not off["unit_buckets"] and not off["contiguous"]
        if world == 1:  # nothing is reduced on one rank: the switch has no effect
            assert not on["unit_buckets"]
            continue
        assert on["unit_buckets"] and on["contiguous"]
        assert on["delivered_all"], "every bucket started is delivered (the fold counts line up with the buckets)"
        assert not on["mixed"], f"a bucket mixed two blocks' gradients: {on['mixed']}"
        # 500-element buckets cut every ~2.4k-element block into several; unit buckets take one per block.
        assert on["buckets_per_backward"] < off["buckets_per_backward"]
        assert on["block_runs"] and all(r == 1 for r in on["block_runs"]), on["block_runs"]
        if world == 2:  # a two-term sum does not depend on how the buckets were cut
            for k, v in on["weights"].items():
                assert torch.equal(v, off["weights"][k]), k
