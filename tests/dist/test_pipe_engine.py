"""PipelineEngine parity with the single-process reference (gloo, CPU): PP=2 (world 2) and PP=2 x DP=2 (world 4).

One spawn per world size trains every case in turn (process start-up dominates on a 2-core machine). Each rank
returns its losses and its stage's final parameters; the parent compares them with the reference loop over the
same micro-batches (``tests.reference.zero_oracle.reference_train``).
"""

from __future__ import annotations

import pytest
import torch

from tests._harness import run_distributed
from tests.dist._pipe_engine_models import (
    SequentialReference,
    data_iter,
    layer_specs,
    loss_fn,
    pipe_config,
    reference_name,
)
from tests.reference.zero_oracle import reference_train

STEPS = 3
# (name, gas, zero stage, extra config, model kwargs, partition method)
CASES_PP2 = [
    ("fp32_gas1_zero1_clip", 1, 1, {}, {}, "uniform"),
    ("fp32_gas4_clip", 4, 0, {}, {}, "parameters"),
    ("fp32_gas4_tied", 4, 0, {}, {"tied": True}, "parameters"),
    ("bf16_gas4_zero1", 4, 1, {"bf16": {"enabled": True}}, {}, "parameters"),
]
CASES_PP2_DP2 = [
    ("fp32_gas1_clip", 1, 0, {}, {}, "uniform"),
    ("fp32_gas4_tied_zero1", 4, 1, {}, {"tied": True}, "type:Block|Embedding"),
    ("bf16_gas4_zero1", 4, 1, {"bf16": {"enabled": True}}, {}, "parameters"),
]


def _train_cases(pp: int, cases: list) -> dict[str, dict]:
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.runtime.pipe.module import PipelineModule

    out = {}
    for name, gas, stage, extra, model_kw, method in cases:
        dp = dist.get_world_size() // pp
        module = PipelineModule(
            layer_specs(**model_kw),
            num_stages=pp,
            loss_fn=loss_fn,
            seed_layers=True,
            seed_fn=torch.manual_seed,
            base_seed=1234,
            partition_method=method,
        )
        engine, _, _, _ = deepspeed.initialize(model=module, config=pipe_config(gas, stage=stage, dp=dp, **extra))
        it = data_iter(STEPS, gas, dp, engine.grid.get_data_parallel_rank())
        losses = [float(engine.train_batch(it)) for _ in range(STEPS)]
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
        out[name] = {"losses": losses, "params": params, "stage": engine.stage_id}
    return out


def _reference(name: str, gas: int, dp: int, extra: dict, model_kw: dict) -> tuple[list[float], dict]:
    model = SequentialReference(layer_specs(**model_kw))
    dtype = torch.bfloat16 if "bf16" in extra else torch.float32
    losses = reference_train(
        model,
        STEPS,
        dp,
        gas,
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
        clip=0.5,
        working_dtype=dtype,
    )
    return losses, {n: p.detach().float() for n, p in model.named_parameters()}


def _check(results: list[dict], cases: list, dp: int, pp: int = 2) -> None:
    for name, gas, _, extra, model_kw, _ in cases:
        ref_losses, ref_params = _reference(name, gas, dp, extra, model_kw)
        bf16 = "bf16" in name
        for rank_result in results:
            got = rank_result[name]
            tol = 2e-2 if bf16 else 1e-5
            assert got["losses"] == pytest.approx(ref_losses, rel=tol, abs=tol), (name, got["losses"], ref_losses)
            for pname, value in got["params"].items():
                ref = ref_params[reference_name(pname)]
                if bf16:  # same recipe as the bf16 reference; summation order differs (bf16 reduction across ranks)
                    rel = float((value - ref).norm() / ref.norm())
                    assert rel < 2e-2, f"{name} {pname}: relative error {rel:.3g} vs the bf16 reference"
                else:
                    torch.testing.assert_close(value, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {pname}: {m}")
        # Every stage's parameters are checked, and the run moved them, or parity would be vacuous.
        assert {r[name]["stage"] for r in results} == set(range(pp))
        assert ref_losses[0] != ref_losses[-1]


def test_pipe_parity_pp2() -> None:
    _check(run_distributed(_train_cases, 2, 2, CASES_PP2, timeout=240), CASES_PP2, dp=1)


def test_pipe_parity_pp2_dp2() -> None:
    _check(run_distributed(_train_cases, 4, 2, CASES_PP2_DP2, timeout=300), CASES_PP2_DP2, dp=2)


def test_single_stage_pipeline_is_plain_data_parallelism() -> None:
    cases = [("fp32_gas4_zero1_pp1", 4, 1, {}, {}, "parameters")]
    _check(run_distributed(_train_cases, 2, 1, cases, timeout=240), cases, dp=2, pp=1)
