"""The overlapped host step of an offloaded optimizer ([Note: overlapped host step]) is bit-identical to the
synchronous one, at ZeRO-2 and ZeRO-3, on one and two ranks; its staging buffers come from a bounded pool that
allocates only on the first step ([Note: pinned pool])."""

from __future__ import annotations

import pytest
import torch

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch
from tests.reference.zero_oracle import engine_micro_index

STEPS = 3
CHUNK = 256  # elements per step chunk: the tiny model's groups step in several chunks


def _config(stage: int, overlap: bool, short_switch: bool = True) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_clipping": 0.5,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 400,
            "stage3_param_persistence_threshold": 30,
            "offload_optimizer": {"device": "cpu"},
            "lean_overlap_offload_step": overlap,
            "lean_short_switch_interval": short_switch,
        },
    }


def optimizer_snapshot(engine) -> dict:
    """The weights (gathered at ZeRO-3), the masters and the inner optimizer's tensor states of ``engine``."""
    from contextlib import nullcontext

    import deepspeed

    params = list(engine.module.parameters())
    gather = deepspeed.zero.GatheredParameters(params) if any(hasattr(p, "ds_id") for p in params) else nullcontext()
    with gather:
        weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    opt = engine.optimizer
    return {
        "weights": weights,
        "masters": [g.master.data.clone() for g in opt.groups],
        "state": [{k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for s in opt.optimizer.state.values()],
    }


def assert_bit_equal(a: dict, b: dict) -> None:
    """Two :func:`optimizer_snapshot` results hold the same bits."""
    for x, y in zip(a["masters"], b["masters"], strict=True):
        assert torch.equal(x, y)
    for k in b["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), k
    for sa, sb in zip(a["state"], b["state"], strict=True):
        for k in sb:
            assert torch.equal(sa[k], sb[k]), k


def _train(world: int, stage: int, overlap: bool, short_switch: bool = True) -> dict:
    import deepspeed
    import deepspeed._core.optim.stage3 as stage3
    import deepspeed._core.optim.stage12 as stage12
    from deepspeed import comm as dist

    for module in (stage12, stage3):  # small chunks, same for both orders
        module.step_chunk_numel = lambda *_: CHUNK  # type: ignore[assignment]
    engine, *_ = deepspeed.initialize(model=make_model(0), config=_config(stage, overlap, short_switch))
    opt = engine.optimizer
    allocations = []
    for step in range(STEPS):
        engine.backward(engine(*micro_batch(step, engine_micro_index(0, dist.get_rank(), world))))
        engine.step()
        allocations.append(opt.pinned.allocations)
    published = opt.host_step.chunks_published if opt.host_step is not None else 0
    result = {
        **optimizer_snapshot(engine),
        "published": published,
        "short_switch": opt.host_step.handoff.value == "short_switch" if opt.host_step is not None else None,
        "allocations": allocations,
        "held": opt.pinned.held_bytes,
        "bound": opt.pinned.max_bytes,
        "chunks": sum(-(-g.master.numel() // CHUNK) for g in opt.groups),
    }
    engine.destroy()
    return result


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("world", [1, 2])
def test_overlapped_offload_step_is_bit_identical_to_the_synchronous_one(world: int, stage: int) -> None:
    short_switch = world == 1  # the switch interval is timing only: both settings give the same bits
    overlapped = run_distributed(_train, world, world, stage, True, short_switch)
    synchronous = run_distributed(_train, world, world, stage, False)
    for over, sync in zip(overlapped, synchronous, strict=True):
        assert over["short_switch"] is short_switch  # lean_short_switch_interval reaches the host worker
        assert over["chunks"] > 2  # several chunks per step, so the pipeline really interleaves
        assert over["published"] == STEPS * over["chunks"], "the overlapped route did not run"
        assert sync["published"] == 0
        assert_bit_equal(over, sync)
        # The pool allocates its staging buffers on the first step only, within its bound.
        allocs = over["allocations"]
        assert allocs[0] > 0 and allocs == [allocs[0]] * STEPS, allocs
        assert 0 < over["held"] <= over["bound"]
