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


def _config(stage: int, overlap: bool) -> dict:
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
        },
    }


def _train(world: int, stage: int, overlap: bool) -> dict:
    import deepspeed
    import deepspeed._core.optim.stage3 as stage3
    import deepspeed._core.optim.stage12 as stage12
    from deepspeed import comm as dist

    for module in (stage12, stage3):  # small chunks, same for both orders
        module.step_chunk_numel = lambda *_: CHUNK  # type: ignore[assignment]
    engine, *_ = deepspeed.initialize(model=make_model(0), config=_config(stage, overlap))
    opt = engine.optimizer
    allocations = []
    for step in range(STEPS):
        engine.backward(engine(*micro_batch(step, engine_micro_index(0, dist.get_rank(), world))))
        engine.step()
        allocations.append(opt.pinned.allocations)
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    else:
        weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    state = [
        {k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for s in opt.optimizer.state.values()
    ]
    masters = [g.master.data.clone() for g in opt.groups]
    published = opt.host_step.chunks_published if opt.host_step is not None else 0
    result = {
        "weights": weights,
        "state": state,
        "masters": masters,
        "published": published,
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
    overlapped = run_distributed(_train, world, world, stage, True)
    synchronous = run_distributed(_train, world, world, stage, False)
    for over, sync in zip(overlapped, synchronous, strict=True):
        assert over["chunks"] > 2  # several chunks per step, so the pipeline really interleaves
        assert over["published"] == STEPS * over["chunks"], "the overlapped route did not run"
        assert sync["published"] == 0
        for a, b in zip(over["masters"], sync["masters"], strict=True):
            assert torch.equal(a, b)
        for k in sync["weights"]:
            assert torch.equal(over["weights"][k], sync["weights"][k]), k
        for sa, sb in zip(over["state"], sync["state"], strict=True):
            for k in sb:
                assert torch.equal(sa[k], sb[k]), k
        # The pool allocates its staging buffers on the first step only, within its bound.
        allocs = over["allocations"]
        assert allocs[0] > 0 and allocs == [allocs[0]] * STEPS, allocs
        assert 0 < over["held"] <= over["bound"]
