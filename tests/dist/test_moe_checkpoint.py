"""MoE checkpoints: upstream's expert-file layout, exact resume in new processes, zero_to_fp32 with experts."""

from __future__ import annotations

import os

import torch

from tests._harness import run_distributed
from tests.dist import _moe_model as mm
from tests.dist.test_moe_parity import _config
from tests.reference import moe_reference as ref

EP = 2
K = 2


def _engine(stage: int):  # noqa: ANN202
    import deepspeed
    from deepspeed import comm as dist

    model = mm.build(EP, dist.get_rank() % EP, K, 1.0, 1)
    engine, *_ = deepspeed.initialize(model=model, config=_config(stage))
    return engine, model


def _steps(engine, first: int, last: int) -> list[float]:  # noqa: ANN001
    from deepspeed import comm as dist

    losses = []
    for step in range(first, last):
        loss = engine(*ref.batch(step, dist.get_rank()))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _save_run(stage: int, save_dir: str) -> dict:
    from deepspeed import comm as dist

    engine, model = _engine(stage)
    _steps(engine, 0, 2)
    engine.save_checkpoint(save_dir, tag="t2")
    losses = _steps(engine, 2, 4)
    out = {"losses": losses, "shared": mm.shared_state(model), "experts": mm.expert_states(model, dist.get_rank() % EP)}
    engine.destroy()
    return out


def _resume_run(stage: int, save_dir: str) -> dict:
    from deepspeed import comm as dist

    engine, model = _engine(stage)
    path, _ = engine.load_checkpoint(save_dir)
    assert path is not None and engine.global_steps == 2
    losses = _steps(engine, 2, 4)
    out = {"losses": losses, "shared": mm.shared_state(model), "experts": mm.expert_states(model, dist.get_rank() % EP)}
    engine.destroy()
    return out


STAGES = (0, 2)


def _save_runs(root: str) -> dict:
    return {stage: _save_run(stage, os.path.join(root, f"stage{stage}")) for stage in STAGES}


def _resume_runs(root: str) -> dict:
    return {stage: _resume_run(stage, os.path.join(root, f"stage{stage}")) for stage in STAGES}


def test_moe_checkpoint_layout_and_exact_resume(tmp_path: object) -> None:
    # One 4-rank run saves (stages 0 and 2), fresh processes resume; ep_size 2 leaves two writers per expert group.
    root = str(tmp_path)
    straight = run_distributed(_save_runs, 4, root, timeout=240.0)
    resumed = run_distributed(_resume_runs, 4, root, timeout=240.0)
    for stage in STAGES:
        _check_layout(os.path.join(root, f"stage{stage}"), stage)
        _check_same([r[stage] for r in straight], [r[stage] for r in resumed])


def _check_layout(save_dir: str, stage: int) -> None:
    files = set(os.listdir(os.path.join(save_dir, "t2")))
    experts = {f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(ref.NUM_EXPERTS)}
    assert experts <= files and "mp_rank_00_model_states.pt" in files
    if stage == 0:
        assert {f"expp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(EP)} <= files
    else:
        assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)} <= files
    main = torch.load(os.path.join(save_dir, "t2", "mp_rank_00_model_states.pt"), weights_only=False)
    assert not any("deepspeed_experts" in key for key in main["module"])
    one = torch.load(os.path.join(save_dir, "t2", "layer_0_expert_3_mp_rank_00_model_states.pt"), weights_only=False)
    assert set(one) == {f"moe.deepspeed_moe.experts.deepspeed_experts.3.{n}" for n in ref.expert_values(0)}


def _check_same(straight: list[dict], resumed: list[dict]) -> None:
    for a, b in zip(straight, resumed):
        assert a["losses"] == b["losses"]
        for name in a["shared"]:
            torch.testing.assert_close(a["shared"][name], b["shared"][name], atol=0, rtol=0)
        for eid in a["experts"]:
            for name in a["experts"][eid]:
                torch.testing.assert_close(a["experts"][eid][name], b["experts"][eid][name], atol=0, rtol=0)


def test_zero_to_fp32_includes_every_expert(tmp_path: object) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from tests.dist import test_moe_parity as parity

    save_dir = str(tmp_path)
    run_distributed(_save_two_steps, 4, save_dir, timeout=180.0)
    state = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="t2")
    expected = ref.reference_train(4, 2, K, parity.CAPACITY_FACTOR, parity.MIN_CAPACITY, parity.LR, parity.CLIP)
    names = {
        "inp.weight": "inp.weight",
        "inp.bias": "inp.bias",
        "wg": "moe.deepspeed_moe.gate.wg.weight",
        "head.weight": "head.weight",
        "head.bias": "head.bias",
    }
    want = {names[n]: v for n, v in expected["shared"].items()}
    for e, values in enumerate(expected["experts"]):
        want.update({f"moe.deepspeed_moe.experts.deepspeed_experts.{e}.{n}": v for n, v in values.items()})
    assert set(state) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(state[name], value, atol=2e-5, rtol=0, msg=name)


def _save_two_steps(save_dir: str) -> None:
    engine, _ = _engine(2)
    _steps(engine, 0, 2)
    engine.save_checkpoint(save_dir, tag="t2")
    engine.destroy()
