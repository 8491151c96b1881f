"""A checkpoint saved under Ulysses SP=2 resumes at SP=1, on the same 2 ranks and on 1 rank.

Under SP the ZeRO shards span every rank (the SP ranks hold the same parameters), so a checkpoint saved at SP=2 on
2 ranks has the layout of a plain 2-rank data-parallel checkpoint: SP=1 on the same 2 ranks reads it as is, and 1
rank reads it by re-partitioning the shards, as for any change of data-parallel size, or, as upstream requires
for a new data-parallel size, after ``ds_to_universal`` with ``checkpoint.load_universal``. Each resumed run takes
one more Adam step (Adam, so the optimizer states must have come back) and must match one process that took both
steps on the whole sequences: step 1 on the SP=2 run's batch, step 2 on the mean of the resumed run's
data-parallel batches.
"""

from __future__ import annotations

import pytest
import torch

from tests._harness import run_distributed
from tests.dist._sp_models import HEADS, batch, loss_sum_and_count, shifted, sp_mean_loss, tiny_llama

pytest.importorskip("transformers")

MICRO, SEQ, LR = 2, 8, 0.01
ATOL = 1e-3 * LR
STAGES = (0, 1, 3)
UNIVERSAL_STAGES = (1, 3)


def _config(stage: int, **extra: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 256},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        **extra,
    }


def _engine(stage: int, mpu=None, **extra: object):
    import deepspeed

    model = tiny_llama("sdpa", HEADS)
    if mpu == "register":
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, MICRO)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, mpu=mpu, config=_config(stage, **extra))
    return engine, mpu


def _full_params(engine) -> dict:
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _leave_sequence_parallel(mpu) -> None:
    """Undo what SP set process-wide, so that this process can train without SP afterwards."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from deepspeed.utils import groups

    mpu._release_sequence_parallel_groups()
    groups.mpu = None
    ALL_ATTENTION_FUNCTIONS["sdpa"] = ALL_ATTENTION_FUNCTIONS["sdpa"]._ulysses_core


def _plain_step(engine, seed: int) -> float:
    b = batch(seed, MICRO, SEQ)
    loss_sum, count = loss_sum_and_count(engine, b["input_ids"], b["position_ids"], shifted(b["labels"]))
    loss = loss_sum / count
    engine.backward(loss)
    engine.step()
    return loss.item()


def _save_at_sp2_resume_at_sp1(save_dir: str) -> dict:
    import os

    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    out = {}
    for stage in STAGES:
        engine, mpu = _engine(stage, "register")
        group = mpu.get_sequence_parallel_group()
        loader = UlyssesSPDataLoaderAdapter([batch(10, MICRO, SEQ)], mpu.get_sequence_parallel_rank(), group, 2, "cpu")
        engine.backward(sp_mean_loss(engine, next(iter(loader)), group))
        engine.step()
        engine.save_checkpoint(os.path.join(save_dir, f"stage{stage}"), tag="t")
        _leave_sequence_parallel(mpu)
        resumed, _ = _engine(stage)  # SP=1: plain data parallelism over both ranks
        resumed.load_checkpoint(os.path.join(save_dir, f"stage{stage}"), tag="t")
        _plain_step(resumed, 20 + dist.get_rank())
        out[stage] = _full_params(resumed)
    return out


def _resume_on_one_rank(save_dir: str) -> dict:
    import os

    out = {}
    for stage in STAGES:
        resumed, _ = _engine(stage)
        resumed.load_checkpoint(os.path.join(save_dir, f"stage{stage}"), tag="t")
        _plain_step(resumed, 20)
        out[stage] = _full_params(resumed)
    for stage in UNIVERSAL_STAGES:
        resumed, _ = _engine(stage, checkpoint={"load_universal": True})
        resumed.load_checkpoint(os.path.join(save_dir, f"universal{stage}"), tag="t")
        _plain_step(resumed, 20)
        out[f"universal{stage}"] = _full_params(resumed)
    return out


def _reference(resume_seeds: list[int]) -> dict:
    model = tiny_llama("sdpa", HEADS)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for seeds in ([10], resume_seeds):
        losses = []
        for seed in seeds:
            b = batch(seed, MICRO, SEQ)
            s, c = loss_sum_and_count(model, b["input_ids"], b["position_ids"], shifted(b["labels"]))
            losses.append(s / c)
        optimizer.zero_grad()
        torch.stack(losses).mean().backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _compare(got: dict, want: dict, what: str) -> None:
    # An Adam step moves each weight by about LR whatever the gradient's size, so gradients that differ in their
    # last bits (the SP and DP runs sum token gradients in another order) may move a weight whose gradient is
    # nearly zero differently by a small fraction of LR. ATOL is 0.1% of one step; not restoring the weights or
    # the Adam moments changes weights by a large fraction of LR.
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=ATOL, msg=f"{what} {name}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, list]:
    save_dir = str(tmp_path_factory.mktemp("sp_ckpt"))
    return save_dir, run_distributed(_save_at_sp2_resume_at_sp1, 2, save_dir, timeout=240)


@pytest.mark.parametrize("stage", STAGES)
def test_sp2_checkpoint_resumes_at_sp1_on_the_same_ranks(saved, stage: int) -> None:
    want = _reference([20, 21])
    for rank, result in enumerate(saved[1]):
        _compare(result[stage], want, f"stage {stage} rank {rank}")


@pytest.fixture(scope="module")
def resumed_on_one_rank(saved) -> dict:
    import os

    from deepspeed.checkpoint.ds_to_universal import main, parse_arguments

    for stage in UNIVERSAL_STAGES:
        source = os.path.join(saved[0], f"stage{stage}", "t")
        main(
            parse_arguments(
                ["--input_folder", source, "--output_folder", os.path.join(saved[0], f"universal{stage}", "t")]
            )
        )
    return run_distributed(_resume_on_one_rank, 1, saved[0], timeout=240)[0]


@pytest.mark.parametrize("stage", STAGES)
def test_sp2_checkpoint_resumes_at_sp1_on_one_rank(resumed_on_one_rank, stage: int) -> None:
    # 2 saved ZeRO shards read by 1 rank: the shards are re-partitioned (the data-parallel size changed 2 -> 1).
    _compare(resumed_on_one_rank[stage], _reference([20]), f"stage {stage}")


@pytest.mark.parametrize("stage", UNIVERSAL_STAGES)
def test_sp2_checkpoint_resumes_at_sp1_on_one_rank_through_universal(resumed_on_one_rank, stage: int) -> None:
    # The route upstream offers for a new data-parallel size: ds_to_universal, then checkpoint.load_universal.
    _compare(resumed_on_one_rank[f"universal{stage}"], _reference([20]), f"universal stage {stage}")
