"""``engine.offload_states()`` under ZeRO-3 parks the 16-bit shards too: while offloaded nothing is gathered
(persistent parameters included), and after ``reload_states()`` training continues bit for bit as without the
cycle (world size 2). On CPU the shards already live on the host, so the move itself is checked by the GPU
benchmark (benchmarks/scenarios/memory_options.py); here the partition/regather bookkeeping and the parity are.
"""

from __future__ import annotations

import torch

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch
from tests.reference.zero_oracle import engine_micro_index


def _config(stage: int) -> dict:
    # Threshold 30: the norm and the small biases (23 elements) stay gathered between uses (persistent).
    return {
        "train_micro_batch_size_per_gpu": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 30},
    }


def _train(cycle: bool) -> dict:
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed._core.params.param import ShardedState

    engine, *_ = deepspeed.initialize(model=make_model(0), config=_config(3))
    rank, world = dist.get_rank(), dist.get_world_size()
    manager = engine.zero3_manager
    losses, during = [], {}
    for step in range(4):
        if cycle and step == 2:
            persistent = sum(s.is_persistent for s in manager.states.values())
            engine.offload_states()
            during = {
                "persistent_before": persistent,
                "persistent": sum(s.is_persistent for s in manager.states.values()),
                "gathered": sum(s.state is not ShardedState.SHARDED for s in manager.states.values()),
                "placeholders": all(p.numel() == 0 for p in engine.module.parameters()),
            }
            engine.reload_states()
            during["persistent_after"] = sum(s.is_persistent for s in manager.states.values())
        loss = engine(*micro_batch(step, engine_micro_index(0, rank, world)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
    return {"losses": torch.stack(losses), **during}


def _both() -> tuple[dict, dict]:
    return _train(False), _train(True)


def _lp_params_at_stage2() -> str:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=make_model(0), config=_config(2))
    engine.backward(engine(*micro_batch(0, 0)))
    engine.step()
    try:
        engine.offload_states(include=["lp_params"])
    except ValueError as err:
        return str(err)
    return "no error"


def test_zero3_offload_cycle_parks_everything_and_continues_bit_exactly() -> None:
    for plain, cycled in run_distributed(_both, 2, timeout=120):
        assert torch.equal(plain["losses"], cycled["losses"]), (plain["losses"], cycled["losses"])
        assert cycled["persistent_before"] > 0
        assert cycled["persistent"] == 0 and cycled["gathered"] == 0 and cycled["placeholders"]
        assert cycled["persistent_after"] == cycled["persistent_before"]


def test_lp_params_needs_zero3() -> None:
    message = run_distributed(_lp_params_at_stage2, 1, timeout=60)[0]
    assert "lp_params" in message and "stage 3" in message, message
