"""Expert-parallel MoE training against the single-process reference (every expert local, hand routing).

ep_size 1, 2 and 4 at world size 4 (and 2 at world size 2, 1 at 1), ZeRO stages 0, 1 and 2, top-1 and
top-2: per-step losses, the global gradient norm (each expert counted once) with clipping active, and
the final shared and expert values must match the reference trained on every rank's batches.
"""

from __future__ import annotations

import pytest
import torch

from tests._harness import run_distributed
from tests.dist import _moe_model as mm
from tests.reference import moe_reference as ref

STEPS = 3
LR = 0.02
CLIP = 0.3  # below the first steps' norms, so clipping is exercised
CAPACITY_FACTOR = 1.0
MIN_CAPACITY = 1


def _config(stage: int, dtype: str = "fp32", gas: int = 1) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": ref.TOKENS_SHAPE[0],
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 300},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def _train(
    stage: int, ep_size: int, k: int, dtype: str = "fp32", data_before_expert: bool = False, gas: int = 1
) -> dict:
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.utils import groups

    rank = dist.get_rank()
    # Expert-parallel groups are blocks of consecutive ranks; with data before expert parallelism they are strided.
    ep_rank = rank // (dist.get_world_size() // ep_size) if data_before_expert else rank % ep_size
    model = mm.build(ep_size, ep_rank, k, CAPACITY_FACTOR, MIN_CAPACITY)
    config = _config(stage, dtype, gas)
    if data_before_expert:
        config["use_data_before_expert_parallelism"] = True
    engine, *_ = deepspeed.initialize(model=model, config=config)
    assert groups._get_expert_parallel_rank(f"ep_size_{ep_size}") == ep_rank
    losses, norms = [], []
    dtype_t = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    for step in range(STEPS):
        window = 0.0
        for micro in range(gas):  # micro-batch m of rank r is the reference's batch of virtual rank r * gas + m
            x, y = ref.batch(step, rank * gas + micro)
            loss = engine(x.to(dtype_t), y)
            engine.backward(loss)
            engine.step()
            window += float(loss.detach()) / gas
        losses.append(window)
        norms.append(engine.get_global_grad_norm())
    out = {
        "losses": losses,
        "norms": norms,
        "shared": mm.shared_state(model),
        "experts": mm.expert_states(model, ep_rank),
    }
    engine.destroy()
    return out


def _sweep(cases: list[tuple]) -> dict:
    return {case: _train(*case) for case in cases}


def _check(results: list[dict], world: int, case: tuple, expected: dict, atol: float) -> None:
    per_rank = [r[case] for r in results]
    mean_losses = [sum(r["losses"][s] for r in per_rank) / world for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(mean_losses), torch.tensor(expected["losses"]), atol=atol, rtol=0)
    for r in per_rank:
        torch.testing.assert_close(
            torch.tensor(r["norms"], dtype=torch.float64),
            torch.tensor(expected["norms"], dtype=torch.float64),
            atol=atol,
            rtol=1e-4,
        )
        for name, value in r["shared"].items():
            torch.testing.assert_close(value, expected["shared"][name], atol=atol, rtol=0, msg=f"{case} {name}")
        for eid, values in r["experts"].items():
            for name, value in values.items():
                torch.testing.assert_close(
                    value, expected["experts"][eid][name], atol=atol, rtol=0, msg=f"{case} expert {eid} {name}"
                )
    # Every expert is held by some rank, so the comparison covered all of them.
    assert {e for r in per_rank for e in r["experts"]} == set(range(ref.NUM_EXPERTS))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_expert_parallel_parity(world: int) -> None:
    # (stage, ep_size, k): every stage and both gatings at each world size, every ep size at world 4.
    cases = {
        1: [(0, 1, 1), (1, 1, 2), (2, 1, 2)],
        2: [(0, 2, 2), (1, 2, 1), (2, 2, 2)],
        4: [(0, 1, 2), (1, 2, 2), (2, 2, 1), (0, 4, 1), (1, 4, 2), (2, 4, 2)],
    }[world]
    results = run_distributed(_sweep, world, cases, timeout=240.0)
    references = {k: ref.reference_train(world, STEPS, k, CAPACITY_FACTOR, MIN_CAPACITY, LR, CLIP) for k in (1, 2)}
    assert references[1]["norms"][0] > CLIP and references[2]["norms"][0] > CLIP  # clipping is active
    for case in cases:
        _check(results, world, case, references[case[2]], atol=2e-5)


def test_data_before_expert_parallel_layout() -> None:
    # use_data_before_expert_parallelism: expert-parallel groups {0, 2} and {1, 3}, expert-data groups {0, 1} and
    # {2, 3}. Its own processes: the group registry keeps the first layout created for a size.
    cases = [(0, 2, 2, "fp32", True), (2, 2, 1, "fp32", True)]
    results = run_distributed(_sweep, 4, cases, timeout=240.0)
    references = {k: ref.reference_train(4, STEPS, k, CAPACITY_FACTOR, MIN_CAPACITY, LR, CLIP) for k in (1, 2)}
    for case in cases:
        _check(results, 4, case, references[case[2]], atol=2e-5)


def test_gradient_accumulation_with_experts() -> None:
    # Two micro-batches per step at world 2 train like the reference over 4 batches (every stage's accumulation
    # path, ZeRO-1's full-size accumulator included, with the expert groups' own process groups).
    cases = [(0, 2, 2, "fp32", False, 2), (1, 2, 2, "fp32", False, 2), (2, 2, 1, "fp32", False, 2)]
    results = run_distributed(_sweep, 2, cases, timeout=240.0)
    references = {k: ref.reference_train(4, STEPS, k, CAPACITY_FACTOR, MIN_CAPACITY, LR, CLIP) for k in (1, 2)}
    for case in cases:
        _check(results, 2, case, references[case[2]], atol=2e-5)
