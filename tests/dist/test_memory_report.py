"""``memory_breakdown``: the engine reports allocated / reserved / peak memory at each phase of a step, next to
the model-state floor of docs/memory_floors.md for this model, stage, world size and offload."""

from __future__ import annotations

import pytest

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch


def _phases(world: int, stage: int, offload: bool) -> dict:
    import deepspeed
    from deepspeed import comm as dist

    zero: dict = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "memory_breakdown": True,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": zero,
    }
    engine, *_ = deepspeed.initialize(model=make_model(0), config=cfg)
    n_params = sum(p.numel() for p in make_model(0).parameters())
    for step in range(2):
        engine.backward(engine(*micro_batch(step, dist.get_rank())))
        engine.step()
    records = [dict(r) for r in engine._loop.memory.records]
    floor = engine._loop.memory.floor
    engine.destroy()
    return {"records": records, "n_params": n_params, "host": floor.host, "device": floor.device}


@pytest.mark.parametrize("stage,offload", [(1, False), (2, False), (3, False), (3, True)])
def test_memory_breakdown_reports_every_phase_with_the_floor(stage: int, offload: bool) -> None:
    world = 2
    for r in run_distributed(_phases, world, world, stage, offload):
        phases = [rec["phase"] for rec in r["records"]]
        step = ["after forward", "after backward", "after step"]
        assert phases == ["after initialize"] + step + step, phases
        p = r["n_params"]  # fp32 training: 4-byte params and grads, 8 bytes of Adam moments, no master copy
        per_param = {1: 4 + 4 + 8 / world, 2: 4 + (4 + 8) / world, 3: (4 + 4 + 8) / world}[stage]
        if offload:  # the host holds an fp32 master copy beside the moments; gradients wait in the shards
            per_param -= 8 / world
            assert r["host"] == pytest.approx(12 * p / world)
        assert r["device"] == pytest.approx(per_param * p)
        for rec in r["records"]:
            assert rec["floor_gib"] == pytest.approx(r["device"] / 2**30)
            assert {"allocated_gib", "reserved_gib", "peak_gib"} <= set(rec)


def _off(world: int) -> list:
    import deepspeed
    from deepspeed import comm as dist

    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    engine, *_ = deepspeed.initialize(model=make_model(0), config=cfg)
    engine.backward(engine(*micro_batch(0, dist.get_rank())))
    engine.step()
    return list(engine._loop.memory.records)


def test_memory_breakdown_off_by_default_records_nothing() -> None:
    assert run_distributed(_off, 1, 1) == [[]]


def _host_report(stage: int) -> list:
    import deepspeed
    from deepspeed import comm as dist

    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "memory_breakdown": True,
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}},
    }
    engine, *_ = deepspeed.initialize(model=make_model(0), config=cfg)
    for step in range(2):
        engine.backward(engine(*micro_batch(step, dist.get_rank())))
        engine.step()
    records = [dict(r) for r in engine._loop.memory.records]
    engine.destroy()
    return records


@pytest.mark.parametrize("stage,floor", [(2, 6 + 2), (3, 6)])
def test_memory_report_gives_host_bytes_per_parameter_beside_the_offload_floor(stage: int, floor: int) -> None:
    """16-bit offloaded state: K = 6 (bf16 master and moments) plus, at ZeRO-2, the 2-byte host gradient; at
    ZeRO-3 with one micro-step the gradients wait in the parameters' shards (docs/offload.md)."""
    (records,) = run_distributed(_host_report, 1, stage)
    after_step = [r for r in records if r["phase"] == "after step"]
    assert after_step
    for rec in after_step:
        assert rec["host_floor_bytes_per_param"] == pytest.approx(floor)
        assert floor <= rec["host_bytes_per_param"] <= floor * 1.05, rec
        assert rec["host_rss_gib"] > 0
