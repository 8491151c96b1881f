"""ZeRO-3 with the optimizer offloaded, one micro-step per window: gradients wait for the step in their
parameters' shards ([Note: parked grads]). Parity with the reference, no host gradient chunk, and every read
of a parked shard before the step (gather, safe_get, zero_grad) sees the values and the gradient it should."""

from __future__ import annotations

import pytest
import torch

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch
from tests.reference.zero_oracle import engine_micro_index, reference_train

STEPS, LR = 4, 1e-2


def _config(parked: bool = True, **extra: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 500,
            "stage3_param_persistence_threshold": 30,
            "offload_optimizer": {"device": "cpu"},
            "lean_grads_in_param_shards": parked,
        },
        **extra,
    }


def _full(engine) -> dict:  # noqa: ANN001
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def _train(world: int, tied: bool, parked: bool, bf16: bool) -> dict:
    import deepspeed
    from deepspeed import comm as dist

    cfg = _config(parked, **({"bf16": {"enabled": True}} if bf16 else {}))
    engine, *_ = deepspeed.initialize(model=make_model(0, tied=tied), config=cfg)
    opt = engine.optimizer
    seen: dict = {"parked": [], "host_chunks": []}
    for step in range(STEPS):
        engine.backward(engine(*micro_batch(step, engine_micro_index(0, dist.get_rank(), world))))
        opt.flush()
        seen["parked"].append(len(opt.parked))
        seen["host_chunks"].append(sum(g.accumulator.allocated_numel for g in opt.groups if g.accumulator))
        engine.step()
    seen["weights"] = _full(engine)
    seen["managed"] = sum(len(g.states) for g in opt.groups)  # persistent ones wait in side tensors
    engine.destroy()
    return seen


def _reference(world: int, tied: bool, dtype: torch.dtype = torch.float32) -> dict:
    model = make_model(0, tied=tied)
    reference_train(
        model,
        STEPS,
        world,
        1,
        lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.01),
        clip=1.0,
        working_dtype=dtype,
    )
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def _assert_close_to(ref: dict, weights: dict) -> None:
    for k, v in ref.items():
        rel = float((weights[k] - v).norm() / v.norm())
        assert rel < 1e-6, f"{k}: {rel}"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_parked_gradients_match_the_reference_and_need_no_host_chunks(world: int) -> None:
    ref = _reference(world, tied=False)
    for r in run_distributed(_train, world, world, False, True, False):
        _assert_close_to(ref, r["weights"])
        # Every gradient waited in its shard (or, persistent, a side tensor); no host gradient chunk existed.
        assert r["parked"] == [r["managed"]] * STEPS, r["parked"]
        assert r["host_chunks"] == [0] * STEPS


def test_switch_off_keeps_host_chunks_and_the_same_numerics() -> None:
    on = run_distributed(_train, 2, 2, False, True, True)
    off = run_distributed(_train, 2, 2, False, False, True)
    for a, b in zip(on, off):
        assert b["parked"] == [0] * STEPS and all(n > 0 for n in b["host_chunks"])
        for k in a["weights"]:
            assert torch.equal(a["weights"][k], b["weights"][k]), k  # bf16: bit-identical either way


@pytest.mark.parametrize("world", [1, 2])
def test_tied_parameter_adds_its_second_use_in_its_shard(world: int) -> None:
    """A tied table's second gradient is added where the first waits (its shard), so no host chunk is allocated
    for it, and the result matches the reference."""
    ref = _reference(world, tied=True)
    for r in run_distributed(_train, world, world, True, True, False):
        _assert_close_to(ref, r["weights"])
        assert r["parked"] == [r["managed"]] * STEPS, r["parked"]
        assert r["host_chunks"] == [0] * STEPS


def test_tied_parameter_in_its_shard_gives_the_accumulators_bits() -> None:
    """Adding the second use in the shard rounds once, as adding it in the host accumulator does (bf16 weights, as
    in the switch test above: in fp32 the clipping norm's summation order, which differs between the two homes,
    shows in the last bits)."""
    on = run_distributed(_train, 2, 2, True, True, True)
    off = run_distributed(_train, 2, 2, True, False, True)
    for a, b in zip(on, off, strict=True):
        assert all(n > 0 for n in b["host_chunks"]) and a["host_chunks"] == [0] * STEPS
        for k in a["weights"]:
            assert torch.equal(a["weights"][k], b["weights"][k]), k


def _reads_before_step(world: int) -> dict:
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.utils import safe_get_full_grad

    engine, *_ = deepspeed.initialize(model=make_model(0), config=_config())
    opt = engine.optimizer
    out: dict = {}
    before = _full(engine)  # a gather before the backward: nothing parked yet
    engine.backward(engine(*micro_batch(0, engine_micro_index(0, dist.get_rank(), world))))
    opt.flush()
    parked_before = len(opt.parked)
    during = _full(engine)  # every shard is read: each parked gradient moves out, values come back
    out["values_kept"] = all(torch.equal(before[k], during[k]) for k in before)
    # Shards are free of gradients again; persistent parameters' side tensors never touched a shard.
    out["evicted"] = (parked_before > 0, sum(r.side is None for r in opt.parked.parked.values()))
    out["grad"] = safe_get_full_grad(engine.module.fc1.weight).clone()
    engine.step()
    out["weights"] = _full(engine)
    # zero_grad instead of a step: the parked shards get their values back.
    start = _full(engine)
    engine.backward(engine(*micro_batch(1, engine_micro_index(0, dist.get_rank(), world))))
    opt.flush()
    out["parked_again"] = len(opt.parked)
    engine.optimizer.zero_grad()
    out["restored"] = all(torch.equal(start[k], v) for k, v in _full(engine).items())
    engine.destroy()
    return out


def test_reads_before_the_step_see_values_and_gradients() -> None:
    world = 2
    model = make_model(0)
    reference_train(model, 1, world, 1, lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.01), clip=1.0)
    ref = {k: v.detach().float() for k, v in model.state_dict().items()}
    grad_model = make_model(0)
    for i in range(world):  # the mean gradient of the first step's micro-batches, unclipped
        tokens, labels = micro_batch(0, i)
        (grad_model(tokens, labels) / world).backward()
    want = grad_model.fc1.weight.grad
    for r in run_distributed(_reads_before_step, world, world):
        assert r["values_kept"], "a gather before the step must see the parameter values"
        assert r["evicted"][0] and r["evicted"][1] == 0, r["evicted"]
        torch.testing.assert_close(r["grad"], want, rtol=1e-5, atol=1e-6)
        _assert_close_to(ref, r["weights"])
        assert r["parked_again"] > 0 and r["restored"]
