"""Ulysses sequence parallelism on a tiny Hugging Face Llama against a single process on the whole sequence.

Each rank of an SP group holds half of every sequence; the loss on every SP rank is the sequence's mean token loss
(loss sums gathered differentiably, as the HF Trainer does). After one SGD step (clipping off, so a gradient of the
wrong scale shows in the weights) the parameters must equal those of one process that trained on the whole
sequences. SGD, not Adam: Adam's first step does not depend on the gradient's scale.
"""

from __future__ import annotations

import pytest
import torch

from tests._harness import run_distributed
from tests.dist._sp_models import HEADS, batch, loss_sum_and_count, shifted, sp_mean_loss, tiny_llama

pytest.importorskip("transformers")

LR, MICRO, SEQ = 0.5, 2, 8


def _config(stage: int, **extra: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        **extra,
    }


def _reference(attn: str, kv: int, dp: int) -> dict:
    """One process, whole sequences: the mean over the DP replicas' batches of their mean token loss."""
    model = tiny_llama(attn, kv)
    losses = []
    for d in range(dp):
        b = batch(10 + d, MICRO, SEQ)
        s, c = loss_sum_and_count(model, b["input_ids"], b["position_ids"], shifted(b["labels"]))
        losses.append(s / c)
    loss = torch.stack(losses).mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return {"loss": loss.item(), "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _sp_engine(attn: str, kv: int, sp: int, stage: int, **extra: object):
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    model = tiny_llama(attn, kv)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, attn, sp, MICRO, seq_length_is_variable=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, mpu=mpu, config=_config(stage, **extra))
    return engine, mpu


def _sp_micro(mpu, dp_rank: int) -> dict:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    loader = UlyssesSPDataLoaderAdapter(
        [batch(10 + dp_rank, MICRO, SEQ)],
        mpu.get_sequence_parallel_rank(),
        mpu.get_sequence_parallel_group(),
        mpu.get_sequence_parallel_world_size(),
        torch.device("cpu"),
    )
    assert len(loader) == mpu.get_sequence_parallel_world_size()
    return next(iter(loader))  # every SP rank brought the same batch: the first is the DP replica's batch


def _train_one_step(attn: str, kv: int, sp: int, stage: int) -> dict:
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    engine, mpu = _sp_engine(attn, kv, sp, stage)
    assert engine.dp_world_size == dist.get_world_size() // sp and engine.seq_dp_world_size == dist.get_world_size()
    micro = _sp_micro(mpu, dist.get_rank() // sp)
    loss = sp_mean_loss(engine, micro, mpu.get_sequence_parallel_group())
    engine.backward(loss)
    engine.step()
    with GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    mpu._release_sequence_parallel_groups()
    return {"loss": loss.item(), "params": params}


def _compare(results: list[dict], ref: dict, dp: int) -> None:
    for rank, got in enumerate(results):
        if dp == 1:
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), rank
        for name, want in ref["params"].items():
            torch.testing.assert_close(got["params"][name], want, rtol=1e-4, atol=1e-5, msg=f"rank {rank} {name}")


@pytest.mark.parametrize("attn, stage", [("sdpa", 1), ("sdpa", 2), ("sdpa", 3), ("eager", 3)])
def test_sp2_matches_whole_sequence(attn: str, stage: int) -> None:
    results = run_distributed(_train_one_step, 2, attn, HEADS, 2, stage)
    _compare(results, _reference(attn, HEADS, 1), dp=1)


def test_gqa_fewer_kv_heads_than_sp_ranks() -> None:
    # One key/value head for SP=2: each rank gets a copy of it (repeated before the exchange).
    results = run_distributed(_train_one_step, 2, "sdpa", 1, 2, 2)
    _compare(results, _reference("sdpa", 1, 1), dp=1)


def test_sp2_dp2_matches_whole_sequence() -> None:
    results = run_distributed(_train_one_step, 4, "sdpa", HEADS, 2, 2)
    _compare(results, _reference("sdpa", HEADS, 2), dp=2)


# ---------------------------------------------------------------------- bad input: every rank raises, none waits
def _expect_error(case: str) -> str:
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    try:
        if case == "seq":
            engine_mpu = UlyssesSPAttentionHF.register_with_transformers(tiny_llama("sdpa"), "sdpa", 2, MICRO)
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

            b = batch(0, MICRO, SEQ + 1)
            group = engine_mpu.get_sequence_parallel_group()
            next(iter(UlyssesSPDataLoaderAdapter([b], engine_mpu.get_sequence_parallel_rank(), group, 2, "cpu")))
        elif case == "world":
            deepspeed.initialize(
                model=tiny_llama("sdpa"),
                config={**_config(2), "sequence_parallel_size": 3, "optimizer": {"type": "Adam"}},
            )
        elif case == "heads":
            UlyssesSPAttentionHF.register_with_transformers(tiny_llama("sdpa", 1, heads=3), "sdpa", 2, MICRO)
        elif case == "kv_heads":
            UlyssesSPAttentionHF.register_with_transformers(tiny_llama("sdpa", 3, heads=6), "sdpa", 2, MICRO)
    except (ValueError, RuntimeError) as err:
        from deepspeed._core.sequence import groups

        groups.release_sequence_parallel_groups()
        return str(err)
    raise AssertionError(f"{case}: no error")


@pytest.mark.parametrize(
    "case, words",
    [
        ("seq", ["9", "not divisible", "sequence parallel size 2"]),
        ("world", ["sequence_parallel_size", "3", "world size (2)"]),
        ("heads", ["attention heads (3)", "sequence parallel size (2)"]),
        ("kv_heads", ["key/value heads (3)", "(2)"]),
    ],
)
def test_bad_input_raises_on_every_rank(case: str, words: list[str]) -> None:
    for message in run_distributed(_expect_error, 2, case, timeout=120):
        for word in words:
            assert word in message, message


def test_sp_with_pipeline_is_refused() -> None:
    from deepspeed._core.config.base import DeepSpeedConfigError
    from deepspeed._core.engine.sequence_layout import check_pipeline

    check_pipeline(1, True)
    check_pipeline(2, False)
    with pytest.raises(DeepSpeedConfigError, match="sequence_parallel_size=2 cannot be combined with pipeline"):
        check_pipeline(2, True)


# ---------------------------------------------------------------------- checkpoints
def _step(engine, mpu) -> float:
    import deepspeed.comm as dist

    micro = _sp_micro(mpu, dist.get_rank() // mpu.get_sequence_parallel_world_size())
    loss = sp_mean_loss(engine, micro, mpu.get_sequence_parallel_group())
    engine.backward(loss)
    engine.step()
    return loss.item()


def _save_then_resume(stage: int, save_dir: str) -> dict:
    import os

    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    def params(engine) -> dict:
        with GatheredParameters(list(engine.module.parameters())):
            return {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    engine, mpu = _sp_engine("sdpa", HEADS, 2, stage)
    _step(engine, mpu)
    engine.save_checkpoint(save_dir, tag="t")
    second = _step(engine, mpu)
    want = params(engine)
    fresh, mpu = _sp_engine("sdpa", HEADS, 2, stage)  # the groups exist: registration reuses them
    fresh.load_checkpoint(save_dir, tag="t")
    again = _step(fresh, mpu)
    got = params(fresh)
    mpu._release_sequence_parallel_groups()
    return {
        "files": sorted(os.listdir(os.path.join(save_dir, "t"))),
        "losses": (second, again),
        "want": want,
        "got": got,
    }


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_save_load_under_sp(stage: int, tmp_path) -> None:
    results = run_distributed(_save_then_resume, 2, stage, str(tmp_path))
    files = results[0]["files"]
    if stage == 1:  # module states once (rank 0), one ZeRO shard per rank, no model-parallel rank but 00
        assert files == [
            "mp_rank_00_model_states.pt",
            "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        ], files
    else:
        assert files == [
            "zero_pp_rank_0_mp_rank_00_model_states.pt",
            "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_1_mp_rank_00_model_states.pt",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        ]
    for r in results:
        assert r["losses"][0] == pytest.approx(r["losses"][1], rel=1e-6)
        for name, want in r["want"].items():
            torch.testing.assert_close(r["got"][name], want, rtol=0, atol=0, msg=name)


def _config_key_only() -> tuple:
    import deepspeed
    import deepspeed.comm as dist

    model = tiny_llama("sdpa")
    config = {**_config(2), "sequence_parallel_size": 2}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config)
    out = (
        engine.sequence_parallel_size,
        engine.dp_world_size,
        engine.seq_dp_world_size,
        dist.get_world_size(group=engine.seq_parallel_group),
        engine.train_batch_size(),
    )
    engine.mpu._release_sequence_parallel_groups()
    return out


def test_config_key_alone_builds_the_groups() -> None:
    # world 2, SP 2: one data-parallel replica, ZeRO over both ranks, train_batch_size = micro * 1 replica.
    assert run_distributed(_config_key_only, 2) == [(2, 1, 2, 2, MICRO)] * 2
