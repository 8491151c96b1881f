"""The pipeline activation-release invariant ([Note: pipeline activation release]), measured on live tensors.

Every activation tensor of a step (loaded inputs, received inputs, outputs) is tracked through a weak reference,
so what is counted is what is really alive in the process, wherever a reference hides. With the lean switch on,
stage ``s`` of ``P`` never has more than ``min(P - s, G)`` micro-batches alive and the last stage at most one after
each backward; with it off (upstream's behaviour) the last stage's count grows to ``G``, so the test can fail. A
step skipped because one stage overflowed in fp16 is skipped on every stage and frees the same as a normal step.
"""

from __future__ import annotations

import torch

from tests._harness import run_distributed
from tests.dist._pipe_engine_models import data_iter, layer_specs, loss_fn, pipe_config

GAS_VALUES = (1, 2, 4, 8)


def _engine(pp: int, gas: int, lean: bool, **extra: object) -> object:
    import deepspeed
    from deepspeed.runtime.pipe.module import PipelineModule

    module = PipelineModule(layer_specs(scale=True), num_stages=pp, loss_fn=loss_fn, partition_method="uniform")
    zero = {"lean_pipeline_release": lean, **extra.pop("zero", {})}  # type: ignore[dict-item]
    engine, _, _, _ = deepspeed.initialize(model=module, config=pipe_config(gas, zero=zero, **extra))
    return engine


def _measure(engine: object, gas: int) -> dict:
    """Train one batch; live micro-batches after every instruction, and after each backward."""
    after_backward: list[int] = []
    peak = [0]

    def observe(name: str, cmd: object, buffers: object) -> None:
        alive = buffers.ledger.observe()
        peak[0] = max(peak[0], alive)
        if name == "BackwardPass":
            after_backward.append(alive)

    engine._executor.observer = observe
    engine.train_batch(data_iter(1, gas, 1, 0))
    return {
        "peak": peak[0],
        "after_backward": after_backward,
        "after_step": len(engine._executor.last_run.buffers.ledger.live()),
        "pending_sends": engine._executor.link.pending_sends(),
    }


def _release_across_gas(pp: int) -> dict:
    out = {}
    for lean in (True, False):
        for gas in GAS_VALUES:
            engine = _engine(pp, gas, lean)
            out[(lean, gas)] = {**_measure(engine, gas), "stage": engine.stage_id}
    return out


def test_live_activations_per_stage_pp4() -> None:
    pp = 4
    results = run_distributed(_release_across_gas, 4, pp, timeout=300)
    for r in results:
        for (lean, gas), got in r.items():
            stage = got["stage"]
            bound = min(pp - stage, gas)
            assert got["after_step"] == 0 and got["pending_sends"] == 0, (lean, gas, got)
            if lean or stage != pp - 1:
                # 1F1B legitimately holds min(P - s, G) on stage s, and reaches it.
                assert got["peak"] == bound, (lean, gas, got)
            if stage == pp - 1:
                assert len(got["after_backward"]) == gas
                if lean:
                    assert max(got["after_backward"]) <= 1, (gas, got)
                else:  # upstream's behaviour: every micro-batch's outputs stay until the step ends
                    assert got["after_backward"] == list(range(1, gas + 1)), (gas, got)
                    assert got["peak"] == gas


def _grad_buffers(engine: object) -> dict:
    probe = getattr(engine.optimizer, "live_grad_buffers", None)
    if probe is not None:
        return probe()
    return {"param_grads": sum(p.grad is not None for p in engine.module.parameters())}


def _fp16_overflows() -> dict:
    """Every (ZeRO stage, GAS) case in one spawn."""
    return {(stage, gas): _fp16_overflow_on_stage0(gas, stage) for stage in (0, 1) for gas in (1, 4)}


def _fp16_overflow_on_stage0(gas: int, zero_stage: int) -> dict:
    from deepspeed import comm as dist

    engine = _engine(
        2,
        gas,
        True,
        fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000, "hysteresis": 1},
        zero={"stage": zero_stage},
    )
    poison = {"on": False}
    if engine.is_first_stage():  # an inf in one gradient of stage 0 only
        first = next(p for p in engine.module.parameters())
        first.register_hook(lambda g: g * float("inf") if poison["on"] else g)
    normal = _measure(engine, gas)
    buffers_after_normal = _grad_buffers(engine)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    scale_before = engine.optimizer.cur_scale
    poison["on"] = True
    skipped = _measure(engine, gas)
    poison["on"] = False
    unchanged = all(torch.equal(before[n], p.detach()) for n, p in engine.module.named_parameters())
    result = {
        "stage": engine.stage_id,
        "normal": normal,
        "skipped": skipped,
        "unchanged": unchanged,
        "skipped_steps": engine.skipped_steps,
        "scale": (scale_before, engine.optimizer.cur_scale),
        "buffers_after_normal": buffers_after_normal,
        "buffers_after_skip": _grad_buffers(engine),
        "overflow": engine.optimizer.overflow,
    }
    third = _measure(engine, gas)  # training goes on after the skip
    result["moved_after"] = any(not torch.equal(before[n], p.detach()) for n, p in engine.module.named_parameters())
    result["third"] = third
    dist.barrier()
    return result


def test_fp16_overflow_on_one_stage_skips_everywhere_and_frees_the_same() -> None:
    results = run_distributed(_fp16_overflows, 2, timeout=300)
    for zero_stage, gas in results[0]:
        assert {r[(zero_stage, gas)]["stage"] for r in results} == {0, 1}
        for rank_results in results:
            r = rank_results[(zero_stage, gas)]
            assert r["overflow"] and r["skipped_steps"] == 1 and r["unchanged"], (zero_stage, gas, r)
            assert r["scale"][1] == r["scale"][0] / 2, r["scale"]
            assert r["skipped"]["after_step"] == r["normal"]["after_step"] == 0
            assert r["skipped"]["peak"] == r["normal"]["peak"] == min(2 - r["stage"], gas)
            assert r["moved_after"]
            # No gradient buffer survives either kind of step (ZeRO-1 reports all of its own; stage 0 has .grad).
            assert r["buffers_after_skip"] == r["buffers_after_normal"]
            assert all(v == 0 for v in r["buffers_after_skip"].values()), r["buffers_after_skip"]
