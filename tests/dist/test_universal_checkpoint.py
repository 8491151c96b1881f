"""Universal checkpoints: ``ds_to_universal`` then ``checkpoint.load_universal`` at another data-parallel size and
ZeRO stage continues training exactly as an uninterrupted run would.

Every run feeds the same global batch per optimizer step (``GLOBAL`` micro-batches: world × gradient accumulation),
so a run that changes world size mid-way is the same computation as the single-process reference of
``tests/reference/zero_oracle.py``; what differs is only the order of the gradient sums (fp32 rounding).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch
from tests.reference.zero_oracle import engine_micro_index, reference_train

GLOBAL = 4  # micro-batches per optimizer step, at every world size
LR = 1e-2


def _config(stage: int, world: int, universal: bool) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": GLOBAL // world,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 400, "allgather_bucket_size": 600},
    }
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def _train(engine, steps: range, world: int) -> None:  # noqa: ANN001
    from deepspeed import comm as dist

    for step in steps:
        for m in range(GLOBAL // world):
            engine.backward(engine(*micro_batch(step, engine_micro_index(m, dist.get_rank(), world))))
            engine.step()


def _full_weights(engine, stage: int) -> dict:  # noqa: ANN001
    if stage == 3:
        return engine._zero3_consolidated_16bit_state_dict()
    return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def _save(stage: int, world: int, save_dir: str, steps: int) -> None:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=make_model(0), config=_config(stage, world, universal=False))
    _train(engine, range(steps), world)
    engine.save_checkpoint(save_dir)


def _resume(stage: int, world: int, load_dir: str, start: int, end: int, save_dir: str | None) -> dict | None:
    """Fresh engine (other init), load the universal checkpoint, train to ``end``; optionally save a regular one."""
    import deepspeed

    engine, *_ = deepspeed.initialize(model=make_model(123), config=_config(stage, world, universal=True))
    path, client = engine.load_checkpoint(load_dir)
    assert path is not None and engine.global_steps == start, (path, engine.global_steps)
    assert "ds_config" in client
    _train(engine, range(start, end), world)
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    return _full_weights(engine, stage)


def _convert(tag_dir: str, out: str) -> None:
    from deepspeed.checkpoint.ds_to_universal import main, parse_arguments

    main(parse_arguments(["--input_folder", tag_dir, "--output_folder", out]))


def _reference(steps: int) -> dict:
    model = make_model(0)
    reference_train(model, steps, GLOBAL, 1, lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.01), clip=1.0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_matches(got: dict, ref: dict, atol: float = 1e-6) -> None:
    assert sorted(got) == sorted(ref)
    for k, v in ref.items():
        torch.testing.assert_close(got[k].float(), v, rtol=1e-5, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


# Upstream's step 3 ran at 2 ranks; here one rank accumulates the same two micro-batches, so the gradient sums
# round differently (measured up to 1.8e-6, the same with a regular, non-universal load of the same files);
# a lost moment or step count moves parameters by about the learning rate (1e-2).
UPSTREAM_ATOL = 5e-6


def test_world2_stage2_to_world1_stage3(tmp_path: object) -> None:
    root = str(tmp_path)
    run_distributed(_save, 2, 2, 2, os.path.join(root, "ckpt"), 3)
    _convert(os.path.join(root, "ckpt", "global_step3"), os.path.join(root, "univ", "step3"))
    assert open(os.path.join(root, "univ", "latest_universal")).read() == "step3"
    got = run_distributed(_resume, 1, 3, 1, os.path.join(root, "univ"), 3, 5, None)[0]
    _assert_matches(got, _reference(5))


def test_round_trip_2_1_2_across_stages(tmp_path: object) -> None:
    """ZeRO-3 at 2 ranks → ZeRO-1 at 1 rank → ZeRO-2 at 2 ranks, converting at each hop."""
    root = str(tmp_path)
    run_distributed(_save, 2, 3, 2, os.path.join(root, "a"), 2)
    _convert(os.path.join(root, "a", "global_step2"), os.path.join(root, "ua", "u"))
    run_distributed(_resume, 1, 1, 1, os.path.join(root, "ua"), 2, 4, os.path.join(root, "b"))
    _convert(os.path.join(root, "b", "global_step4"), os.path.join(root, "ub", "u"))
    results = run_distributed(_resume, 2, 2, 2, os.path.join(root, "ub"), 4, 6, None)
    ref = _reference(6)
    for got in results:
        _assert_matches(got, ref)


def test_converter_matches_consolidated_weights(tmp_path: object) -> None:
    """Each ``fp32.pt`` equals what ``zero_to_fp32`` consolidates; ZeRO-1/2 and ZeRO-3 value formats differ."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root = str(tmp_path)
    for stage in (2, 3):
        ckpt = os.path.join(root, f"s{stage}")
        run_distributed(_save, 2, stage, 2, ckpt, 1)
        out = os.path.join(root, f"u{stage}", "x")
        _convert(os.path.join(ckpt, "global_step1"), out)
        full = get_fp32_state_dict_from_zero_checkpoint(ckpt)
        for name, value in full.items():
            saved = torch.load(os.path.join(out, "zero", name, "fp32.pt"), weights_only=True)
            files = sorted(os.listdir(os.path.join(out, "zero", name)))
            if stage == 2:
                assert saved["cat_dim"] == 0 and saved["param"].shape == value.shape
                assert files == ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"], files
                saved = saved["param"]
            else:
                assert saved.dim() == 1 and files == ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt"], files
            assert torch.equal(saved.reshape(-1), value.reshape(-1)), name
        opt_state = torch.load(os.path.join(out, "zero", "optimizer_state.pt"), weights_only=False)
        assert "param_groups" in opt_state and "fp32_flat_groups" not in opt_state


# --- checkpoints written by upstream DeepSpeed ----------------------------------------------------------------
UPSTREAM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "upstream")


def _load_upstream_universal(load_dir: str, stage: int) -> dict:
    """World 1: load a universal folder made from upstream's ``zero*_ws2`` case and take step 3 with GAS 2."""
    import deepspeed

    cfg = _config(stage, 1, universal=True)
    cfg.update(gradient_accumulation_steps=2, gradient_clipping=0.0)
    cfg["optimizer"]["params"] = {"lr": LR, "torch_adam": True}
    engine, *_ = deepspeed.initialize(model=make_model(123), config=cfg)
    engine.load_checkpoint(load_dir)
    assert engine.global_steps == 2
    for m in range(2):
        engine.backward(engine(*micro_batch(2, m)))
        engine.step()
    return _full_weights(engine, stage)


@pytest.mark.parametrize("case,stage", [("zero2_fp32_ws2", 3), ("zero3_fp32_ws2", 1)])
def test_upstream_checkpoint_through_our_converter(tmp_path: object, case: str, stage: int) -> None:
    out = os.path.join(str(tmp_path), "univ", "u")
    _convert(os.path.join(UPSTREAM, case, "global_step2"), out)
    got = run_distributed(_load_upstream_universal, 1, os.path.dirname(out), stage)[0]
    expected = torch.load(os.path.join(UPSTREAM, case, "expected_step3_fp32.pt"), weights_only=True)
    _assert_matches(got, expected, UPSTREAM_ATOL)


UPSTREAM_UNIVERSAL = os.path.join(os.path.dirname(UPSTREAM), "upstream_universal")


@pytest.mark.parametrize("case,stage", [("zero2_fp32_ws2", 3), ("zero3_fp32_ws2", 2)])
def test_upstream_universal_folder_loads(case: str, stage: int) -> None:
    """Folders written by upstream's own converter (``tests/fixtures/upstream_universal/README.md``) load here."""
    got = run_distributed(_load_upstream_universal, 1, os.path.join(UPSTREAM_UNIVERSAL, case), stage)[0]
    expected = torch.load(os.path.join(UPSTREAM, case, "expected_step3_fp32.pt"), weights_only=True)
    _assert_matches(got, expected, UPSTREAM_ATOL)


# --- bf16 ---------------------------------------------------------------------------------------------------
# After the load, the two runs differ only in how each step's bf16 gradients are summed (2 ranks, or 2 micro-batches
# accumulated on 1 rank): measured up to 9.2e-5 after 2 steps. Loading without the Adam moments moves the same
# parameters by 2e-2 to 3e-2.
BF16_CONTINUE_ATOL = 3e-4


def _bf16_config(stage: int, world: int, universal: bool) -> dict:
    return dict(_config(stage, world, universal), bf16={"enabled": True})


def _masters(engine) -> dict:  # noqa: ANN001
    """Every parameter's full fp32 master (collective under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().float().clone() for n, p in engine.module.named_parameters()}


def _bf16_save_and_continue(stage: int, world: int, save_dir: str, save_at: int, end: int) -> dict:
    """The uninterrupted run: train, save at ``save_at`` (masters recorded), keep training to ``end``."""
    import deepspeed

    engine, *_ = deepspeed.initialize(model=make_model(0), config=_bf16_config(stage, world, universal=False))
    _train(engine, range(save_at), world)
    engine.save_checkpoint(save_dir)
    at_save = _masters(engine)
    _train(engine, range(save_at, end), world)
    return {"at_save": at_save, "end": _masters(engine)}


def _bf16_resume(stage: int, world: int, load_dir: str, start: int, end: int) -> dict:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=make_model(123), config=_bf16_config(stage, world, universal=True))
    engine.load_checkpoint(load_dir)
    assert engine.global_steps == start
    loaded = _masters(engine)
    module = (
        engine._zero3_consolidated_16bit_state_dict()
        if stage == 3
        else {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    )
    _train(engine, range(start, end), world)
    return {"loaded": loaded, "module": module, "end": _masters(engine)}


@pytest.mark.parametrize("src,dst", [(1, 2), (2, 3), (3, 1)])
def test_bf16_world2_to_world1_other_stage(tmp_path: object, src: int, dst: int) -> None:
    """A bf16 ZeRO-``src`` run at 2 ranks, converted and loaded at 1 rank under ZeRO-``dst``, continues as the run
    that was never interrupted: the loaded fp32 masters are the saved ones bit for bit, the bf16 weights are their
    rounding, and two more steps land where the uninterrupted run's do."""
    root = str(tmp_path)
    run = run_distributed(_bf16_save_and_continue, 2, src, 2, os.path.join(root, "ckpt"), 3, 5)[0]
    _convert(os.path.join(root, "ckpt", "global_step3"), os.path.join(root, "univ", "step3"))
    got = run_distributed(_bf16_resume, 1, dst, 1, os.path.join(root, "univ"), 3, 5)[0]
    for name, value in run["at_save"].items():
        assert torch.equal(got["loaded"][name], value), name
        assert got["module"][name].dtype == torch.bfloat16 and torch.equal(got["module"][name], value.bfloat16()), name
    for name, value in run["end"].items():
        torch.testing.assert_close(
            got["end"][name], value, rtol=0, atol=BF16_CONTINUE_ATOL, msg=lambda m, n=name: f"{n} after 2 steps: {m}"
        )


# --- frozen parameters ----------------------------------------------------------------------------------------
def _frozen_save(stage: int, world: int, save_dir: str, steps: int) -> None:
    import deepspeed

    cfg = _config(stage, world, universal=False)
    engine, *_ = deepspeed.initialize(model=make_model(0, frozen_first=True), config=cfg)
    _train(engine, range(steps), world)
    engine.save_checkpoint(save_dir)


def _frozen_resume(stage: int, world: int, load_dir: str, start: int, end: int) -> dict:
    """Other init (so the frozen fc1 starts elsewhere too), load, record every weight, train to ``end``."""
    import deepspeed

    cfg = _config(stage, world, universal=True)
    engine, *_ = deepspeed.initialize(model=make_model(123, frozen_first=True), config=cfg)
    engine.load_checkpoint(load_dir)
    assert engine.global_steps == start
    loaded = _full_weights(engine, stage)
    _train(engine, range(start, end), world)
    return {"loaded": loaded, "end": _full_weights(engine, stage)}


def _frozen_reference(steps: int) -> dict:
    model = make_model(0, frozen_first=True)
    reference_train(model, steps, GLOBAL, 1, lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.01), clip=1.0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("src,dst", [((2, 2), (3, 2)), ((3, 2), (3, 1))])
def test_frozen_parameters_under_zero3_loader(tmp_path: object, src: tuple, dst: tuple) -> None:
    """A model with a frozen layer (fc1), converted and loaded by a ZeRO-3 engine (``(stage, world)`` pairs): the
    frozen weights come back as saved (not the new run's initial values), the trainable ones load, and training
    continues as the single-process reference."""
    root = str(tmp_path)
    run_distributed(_frozen_save, src[1], src[0], src[1], os.path.join(root, "ckpt"), 2)
    _convert(os.path.join(root, "ckpt", "global_step2"), os.path.join(root, "univ", "u"))
    results = run_distributed(_frozen_resume, dst[1], dst[0], dst[1], os.path.join(root, "univ"), 2, 4)
    saved, ref = _frozen_reference(2), _frozen_reference(4)
    fresh = make_model(123, frozen_first=True).state_dict()
    for res in results:
        if res["loaded"] is None:  # ZeRO-3 consolidates on rank 0 only
            continue
        for name in ("fc1.weight", "fc1.bias"):
            assert torch.equal(res["loaded"][name], saved[name]) and not torch.equal(res["loaded"][name], fresh[name])
        _assert_matches(res["loaded"], saved)
        _assert_matches(res["end"], ref)
    assert results[0]["loaded"] is not None
