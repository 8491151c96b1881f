"""Pipeline checkpoints: upstream's layout, exact resume in new processes, elastic load, zero_to_fp32."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from tests._harness import run_distributed

HIDDEN, OUT, SEQ = 6, 3, 4


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.register_buffer("calls", torch.zeros(1))  # a persistent buffer, to check it survives

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def _layers() -> list:
    from deepspeed.pipe import LayerSpec

    return (
        [LayerSpec(nn.Linear, 2, HIDDEN)]
        + [LayerSpec(Block, HIDDEN) for _ in range(3)]
        + [LayerSpec(nn.Linear, HIDDEN, OUT)]
    )


def _batch(step: int, sample: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + sample)
    return torch.randn(1, SEQ, 2, generator=gen), torch.randn(1, SEQ, OUT, generator=gen)


def _config(dp: int, samples: int, stage: int = 1) -> dict:
    return {
        "train_batch_size": samples,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": samples // dp,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": 5e-2}},
        "zero_optimization": {"stage": stage},
    }


def _engine(dp: int, samples: int, stage: int = 1, partition: str = "uniform") -> object:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    module = PipelineModule(
        _layers(), num_stages=2, loss_fn=nn.functional.mse_loss, seed_layers=True, partition_method=partition
    )
    engine, *_ = deepspeed.initialize(
        model=module, model_parameters=module.parameters(), config=_config(dp, samples, stage)
    )
    return engine


def _train(engine: object, step: int, samples: int) -> float:
    grid = engine.module.mpu()
    dp, rank = grid.get_data_parallel_world_size(), grid.get_data_parallel_rank()
    # Every replica takes every dp-th sample, so the global batch is the same at any data-parallel size.
    data = [_batch(step, m * dp + rank) for m in range(samples // dp)]
    return float(engine.train_batch(iter(data)))


def _weights(engine: object) -> dict:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _save_then_continue(save_dir: str, dp: int, samples: int, steps: int, stage: int) -> dict:
    engine = _engine(dp, samples, stage)
    for step in range(2):
        _train(engine, step, samples)
    engine.save_checkpoint(save_dir)
    before = _weights(engine)
    losses = [_train(engine, step, samples) for step in range(2, 2 + steps)]
    return {"losses": losses, "saved": before, "after": _weights(engine), "stage": engine.module.stage_id}


def _resume(save_dir: str, dp: int, samples: int, steps: int, stage: int) -> dict:
    torch.manual_seed(99)  # nothing may depend on the fresh initialisation
    engine = _engine(dp, samples, stage)
    path, client = engine.load_checkpoint(save_dir)
    loaded = _weights(engine)
    losses = [_train(engine, step, samples) for step in range(2, 2 + steps)]
    return {
        "losses": losses,
        "loaded": loaded,
        "after": _weights(engine),
        "path": path,
        "global_steps": engine.global_steps,
        "stage": engine.module.stage_id,
    }


def _load_other_partition(save_dir: str) -> dict:
    """type:Linear gives layers [0, 4) and [4, 5): the stages' ZeRO shards no longer fit, the layer files do."""
    engine = _engine(1, 4, 1, partition="type:Linear")
    try:
        engine.load_checkpoint(save_dir)
        refused = "no error"
    except ValueError as err:
        refused = str(err)
    engine.load_checkpoint(save_dir, load_module_only=True)
    return {"refused": refused, "parts": list(engine.module.parts), "weights": _weights(engine)}


def test_layout_and_exact_resume(tmp_path: os.PathLike) -> None:
    save_dir = str(tmp_path / "ckpt")
    first = run_distributed(_save_then_continue, 2, save_dir, 1, 4, 2, 1, timeout=120)
    tag_dir = os.path.join(save_dir, "global_step2")
    names = sorted(os.listdir(tag_dir))
    layers = [f"layer_{i:02d}-model_states.pt" for i in range(5)]
    assert names == sorted(
        layers
        + [
            "mp_rank_00_model_states.pt",
            "mp_rank_01_model_states.pt",
            "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_0_mp_rank_01_optim_states.pt",
        ]
    ), names
    state = torch.load(os.path.join(tag_dir, "mp_rank_01_model_states.pt"), weights_only=False)
    assert state["module"] is None and state["checkpoint_parallel_dimensions"]["pp_degree"] == 2
    layer = torch.load(os.path.join(tag_dir, "layer_02-model_states.pt"), weights_only=True)
    assert sorted(layer) == ["calls", "fc.bias", "fc.weight"]
    _check_zero_to_fp32(save_dir, first)
    second = run_distributed(_resume, 2, save_dir, 1, 4, 2, 1, timeout=120)
    for a, b in zip(first, second):
        assert a["stage"] == b["stage"] and b["global_steps"] == 4
        for name, value in a["saved"].items():
            assert torch.equal(value, b["loaded"][name]), name
        assert a["losses"] == b["losses"]  # exact: the same computation from the same state
        for name, value in a["after"].items():
            assert torch.equal(value, b["after"][name]), name
    other = run_distributed(_load_other_partition, 2, save_dir, timeout=120)
    saved = {**first[0]["saved"], **first[1]["saved"]}
    assert [o["parts"] for o in other] == [[0, 4, 5], [0, 4, 5]]
    for rep in other:
        assert "load_optimizer_states=False" in rep["refused"], rep["refused"]
        for name, value in rep["weights"].items():
            assert torch.equal(value, saved[name]), name


def test_elastic_load_at_another_data_parallel_size(tmp_path: os.PathLike) -> None:
    """Saved at PP=2 x DP=2, resumed at PP=2 x DP=1 with the same global batch: the same training."""
    save_dir = str(tmp_path / "ckpt")
    wide = run_distributed(_save_then_continue, 4, save_dir, 2, 4, 1, 1, timeout=180)
    tag_dir = os.path.join(save_dir, "global_step2")
    optim = sorted(n for n in os.listdir(tag_dir) if "optim_states" in n)
    assert optim == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_0_mp_rank_01_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_01_optim_states.pt",
    ]
    narrow = run_distributed(_resume, 2, save_dir, 1, 4, 1, 1, timeout=120)
    # Wide ranks 0,1 are stage 0 and 2,3 stage 1; narrow rank s is stage s.
    for wide_rank, rep in ((0, narrow[0]), (2, narrow[1])):
        ref = wide[wide_rank]
        for name, value in ref["saved"].items():
            assert torch.equal(value, rep["loaded"][name]), name
        assert rep["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
        for name, value in ref["after"].items():
            torch.testing.assert_close(rep["after"][name], value, rtol=1e-5, atol=1e-6)


def _module_round_trips(root: str) -> list[str]:
    return [_module_round_trip(os.path.join(root, "a"), False), _module_round_trip(os.path.join(root, "b"), True)]


def _module_round_trip(save_dir: str, missing: bool) -> str:
    from deepspeed.pipe import PipelineModule

    module = PipelineModule(_layers(), num_stages=2, seed_layers=True, partition_method="uniform")
    module.save_state_dict(save_dir)
    other = PipelineModule(_layers(), num_stages=2, seed_layers=True, base_seed=7, partition_method="uniform")
    if missing and module.stage_id == 1:
        os.remove(module.ckpt_layer_path(save_dir, 0))
    try:
        other.load_state_dir(save_dir)
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return f"{type(err).__name__}: {err}"
    same = all(torch.equal(a, b) for a, b in zip(module.state_dict().values(), other.state_dict().values()))
    return "equal" if same else "different"


def test_module_save_load_and_missing_file_fails_everywhere(tmp_path: os.PathLike) -> None:
    (ok0, bad0), (ok1, bad1) = run_distributed(_module_round_trips, 2, str(tmp_path), timeout=60)
    assert ok0 == ok1 == "equal"
    msgs = [bad0, bad1]
    assert "layer_03-model_states.pt" in msgs[1] and "does not exist" in msgs[1], msgs
    assert "failed on 1 other rank" in msgs[0], msgs


def _check_zero_to_fp32(save_dir: str, reports: list) -> None:
    """zero_to_fp32 merges the stages' shards into the whole model's fp32 weights (buffers from layer files)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    expected = {**reports[0]["saved"], **reports[1]["saved"]}
    params = {k: v for k, v in state.items() if not k.endswith("calls")}
    assert sorted(params) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=0)
    assert sorted(k for k in state if k.endswith("calls")) == ["1.calls", "2.calls", "3.calls"]
