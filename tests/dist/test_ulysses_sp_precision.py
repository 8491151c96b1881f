"""Ulysses SP at ZeRO-0 and in bf16: the reduced gradients against one process on the whole sequence.

One world of 2 ranks (SP=2, one data-parallel replica) builds one engine per case in turn and returns, for each,
every parameter's full reduced gradient after ``backward`` and the dtypes the gradient reduction sent. The
reference is a single process that runs the same model on the whole sequences in the same working dtype.

Why the bf16 tolerance: in bf16 each rank's partial weight gradient (its half of the tokens) is rounded to bf16
(8 significant bits: relative error at most 2^-9) before the reduction adds the two halves, whereas the reference
rounds the whole-sequence gradient once. Activations computed on shards may also round differently from the
whole-sequence ones by one bf16 ulp and that difference is carried through two layers. So an element may be off
by a few bf16 ulps of the largest partial gradient, which is bounded by the largest whole gradient of the tensor
for these inputs; the test allows ``8 * 2^-8`` of the tensor's largest reference gradient. A wrong gradient scale
(a missing or doubled average over the SP ranks) is off by 50-100% of every element, far outside that bound.
"""

from __future__ import annotations

import pytest
import torch

from tests._harness import run_distributed
from tests.dist._sp_models import HEADS, batch, loss_sum_and_count, shifted, sp_mean_loss, tiny_llama

pytest.importorskip("transformers")

MICRO, SEQ, SP = 2, 8, 2
BF16_TOL = 8 * 2.0**-8

CASES = {
    "zero0_fp32": (0, False, {}),
    "zero0_bf16": (0, True, {}),
    "zero2_bf16": (2, True, {}),
    "zero3_bf16": (3, True, {}),
    "zero2_bf16_comm_bf16": (2, True, {"seq_parallel_communication_data_type": "bf16"}),
}


def _config(stage: int, bf16: bool, extra: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 256},
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        **extra,
    }


def _record_reduce_dtypes(seen: list) -> None:
    """Make the gradient reducer's collectives note the dtype they send."""
    from deepspeed._core.grads import reducer

    for name in ("start_all_reduce", "start_reduce_scatter", "start_reduce_to_owners"):
        original = getattr(reducer, name)

        def noting(data, *args, _original=original):
            seen.append(data.dtype)
            return _original(data, *args)

        setattr(reducer, name, noting)


def _sp_gradients(cases: dict) -> dict:
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from deepspeed.utils import safe_get_full_grad

    seen: list = []
    _record_reduce_dtypes(seen)
    out = {}
    for name, (stage, bf16, extra) in cases.items():
        model = tiny_llama("sdpa", HEADS)
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", SP, MICRO)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, mpu=mpu, config=_config(stage, bf16, extra))
        group = mpu.get_sequence_parallel_group()
        loader = UlyssesSPDataLoaderAdapter([batch(10, MICRO, SEQ)], mpu.get_sequence_parallel_rank(), group, SP, "cpu")
        seen.clear()
        engine.backward(sp_mean_loss(engine, next(iter(loader)), group))
        grads = {n: safe_get_full_grad(p).detach().float().clone() for n, p in engine.module.named_parameters()}
        out[name] = {
            "grads": grads,
            "wire": sorted({str(d) for d in seen}),
            "comm_dtype": str(engine.communication_data_type),
        }
    mpu._release_sequence_parallel_groups()
    return out


def _reference(bf16: bool) -> dict:
    model = tiny_llama("sdpa", HEADS)
    if bf16:
        model = model.to(torch.bfloat16)
    b = batch(10, MICRO, SEQ)
    loss_sum, count = loss_sum_and_count(model, b["input_ids"], b["position_ids"], shifted(b["labels"]))
    (loss_sum / count).backward()
    return {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def sp_results() -> list:
    return run_distributed(_sp_gradients, 2, CASES, timeout=180)


@pytest.mark.parametrize("case", ["zero0_fp32", "zero0_bf16", "zero2_bf16", "zero3_bf16"])
def test_sp_gradients_match_whole_sequence(sp_results: list, case: str) -> None:
    bf16 = CASES[case][1]
    ref = _reference(bf16)
    for rank, result in enumerate(sp_results):
        for name, want in ref.items():
            got = result[case]["grads"][name]
            if bf16:
                atol = BF16_TOL * want.abs().max().item()
                torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=f"rank {rank} {name}")
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")


def test_bf16_tolerance_catches_a_wrong_gradient_scale(sp_results: list) -> None:
    # The bf16 bound is tight enough to see a gradient off by the SP average (half of it missing).
    ref = _reference(True)
    name = "model.layers.0.self_attn.q_proj.weight"
    halved = sp_results[0]["zero2_bf16"]["grads"][name] / 2
    assert (halved - ref[name]).abs().max() > BF16_TOL * ref[name].abs().max()


def test_seq_parallel_communication_data_type_sets_the_reduction_dtype(sp_results: list) -> None:
    # Without SP a bf16 model reduces in bf16 (communication_data_type unset follows the working dtype); under SP
    # the gradients travel in seq_parallel_communication_data_type: fp32 by default, bf16 when asked.
    for result in sp_results:
        assert result["zero0_bf16"]["wire"] == ["torch.float32"], result["zero0_bf16"]["wire"]
        assert result["zero2_bf16"]["wire"] == ["torch.float32"], result["zero2_bf16"]["wire"]
        assert result["zero2_bf16"]["comm_dtype"] == "torch.float32"
        assert result["zero3_bf16"]["wire"] == ["torch.float32"], result["zero3_bf16"]["wire"]
        assert result["zero2_bf16_comm_bf16"]["wire"] == ["torch.bfloat16"], result["zero2_bf16_comm_bf16"]["wire"]
        assert result["zero2_bf16_comm_bf16"]["comm_dtype"] == "torch.bfloat16"
