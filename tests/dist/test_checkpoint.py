"""Engine checkpoints on gloo: exact resume (stage 0, fp32/bf16/fp16), upstream layout, HF expectations,
client state, safety, corrupt files, and crash consistency (a writer killed mid-save).

Every scenario of one world size runs inside one spawn, because process start-up dominates on 2 cores.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests._harness import DistributedTestError, run_distributed
from tests.reference.models import make_model, micro_batch
from tests.reference.zero_oracle import engine_micro_index

N_STEPS, K_STEPS = 6, 3
PRECISIONS = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    # A short window makes the dynamic scale move, so a lost loss-scaler state would show.
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 6, "loss_scale_window": 2}},
}


def config(precision: str, gas: int = 2, stage: int = 0) -> dict:
    """A small stage-0 run with a scheduler, clipping and accumulation."""
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4},
        },
        "zero_optimization": {"stage": stage},
        **PRECISIONS[precision],
    }


def train(engine: object, first: int, last: int) -> None:
    """Optimizer steps ``first..last-1``; every rank feeds its own micro-batches."""
    from deepspeed import comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    gas = engine.gradient_accumulation_steps()
    for step in range(first, last):
        for m in range(gas):
            engine.backward(engine(*micro_batch(step, engine_micro_index(m, rank, world))))
            engine.step()


def snapshot(engine: object) -> dict:
    """Everything exact resume must reproduce."""
    opt_sd = engine.optimizer.state_dict()
    inner = opt_sd["optimizer_state_dict"]["state"]
    return {
        "weights": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
        "moments": {(i, k): v.clone() for i, s in inner.items() for k, v in s.items() if torch.is_tensor(v)},
        "masters": [t.clone() for t in opt_sd.get("fp32_groups", [])],
        "lr": engine.get_lr(),
        "scale": engine.optimizer.cur_scale,
        "counters": (engine.global_steps, engine.global_samples, engine.skipped_steps),
    }


def assert_same(a: dict, b: dict, what: str) -> None:
    for key in ("lr", "scale", "counters"):
        assert a[key] == b[key], f"{what}: {key} {a[key]} != {b[key]}"
    for group in ("weights", "moments"):
        assert a[group].keys() == b[group].keys()
        for k in a[group]:
            assert torch.equal(a[group][k], b[group][k]), f"{what}: {group}[{k}] differs"
    assert len(a["masters"]) == len(b["masters"])
    assert all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"])), f"{what}: fp32 masters differ"


def _resume_case(root: str, precision: str) -> None:
    import deepspeed

    straight, _, _, _ = deepspeed.initialize(model=make_model(0), config=config(precision))
    train(straight, 0, N_STEPS)
    want = snapshot(straight)
    straight.destroy()

    first, _, _, _ = deepspeed.initialize(model=make_model(0), config=config(precision))
    train(first, 0, K_STEPS)
    assert first.save_checkpoint(root, client_state={"epoch": 7, "note": "hi"}) is True
    at_save = snapshot(first)
    first.destroy()

    # A different model object with different initial weights: everything must come from the files.
    resumed, _, _, _ = deepspeed.initialize(model=make_model(5), config=config(precision))
    path, client = resumed.load_checkpoint(root)
    assert path == os.path.join(root, f"global_step{K_STEPS}")
    assert client["epoch"] == 7 and client["note"] == "hi" and "module" not in client
    assert_same(snapshot(resumed), at_save, f"{precision} right after load")
    train(resumed, K_STEPS, N_STEPS)
    assert_same(snapshot(resumed), want, f"{precision} after resume")
    resumed.destroy()


def _layout_and_hf_expectations(root: str) -> None:
    import deepspeed
    from deepspeed import comm as dist

    engine, _, _, _ = deepspeed.initialize(model=make_model(0, frozen_first=True), config=config("bf16", gas=1))
    assert engine.load_checkpoint(root) == (None, None)  # no `latest`, no tag
    train(engine, 0, 2)
    engine.save_checkpoint(root, exclude_frozen_parameters=True)
    engine.save_checkpoint(root, tag="manual", save_latest=False)
    dist.barrier()
    assert sorted(os.listdir(root)) == ["global_step2", "latest", "manual"]  # no zero_to_fp32.py at stage 0
    assert Path(root, "latest").read_text() == "global_step2"
    assert os.listdir(os.path.join(root, "global_step2")) == ["mp_rank_00_model_states.pt"]
    sd = torch.load(os.path.join(root, "global_step2", "mp_rank_00_model_states.pt"), weights_only=False)
    assert not any(k.startswith("fc1.") for k in sd["module"])  # frozen params excluded
    expected = {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "frozen_param_fragments",
        "shared_params",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "ds_config",
        "ds_version",
    }
    assert expected <= set(sd) and sd["global_steps"] == 2 and sd["dp_world_size"] == dist.get_world_size()
    assert sd["param_shapes"] is None and sd["optimizer"] is not None
    full = torch.load(os.path.join(root, "manual", "mp_rank_00_model_states.pt"), weights_only=False)
    assert "fc1.weight" in full["module"]
    # Loading the frozen-excluded tag needs non-strict module loading, as PEFT resumes do.
    path, _ = engine.load_checkpoint(root, load_module_strict=False)
    assert path.endswith("global_step2")
    try:
        engine.save_checkpoint(root, client_state={"checkpoint_parallel_dimensions": 1})
        raise AssertionError("reserved client_state key accepted")
    except KeyError:
        pass
    engine.destroy()


class NotAllowListed:
    """A client-state object outside the safe-loading allow-list."""

    def __init__(self, value: int) -> None:
        self.value = value


def _safety_and_corruption(root: str) -> None:
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed._core.checkpoint.files import CheckpointCorruptError, CheckpointUnsafeError

    engine, _, _, _ = deepspeed.initialize(model=make_model(0), config=config("fp32", gas=1))
    train(engine, 0, 1)
    engine.save_checkpoint(root, tag="odd", client_state={"blob": NotAllowListed(3)})
    try:
        engine.load_checkpoint(root, tag="odd")
        raise AssertionError("non-allow-listed object loaded without opt-out")
    except CheckpointUnsafeError as err:
        assert "NotAllowListed" in str(err) and f"rank {dist.get_rank()}" in str(err)
    os.environ["DS_CHECKPOINT_TRUSTED"] = "1"
    try:
        _, client = engine.load_checkpoint(root, tag="odd")
    finally:
        del os.environ["DS_CHECKPOINT_TRUSTED"]
    assert client["blob"].value == 3
    dist.barrier()
    model_file = os.path.join(root, "odd", "mp_rank_00_model_states.pt")
    if dist.get_rank() == 0:
        data = Path(model_file).read_bytes()
        Path(model_file).write_bytes(data[: len(data) // 3])
    dist.barrier()
    try:
        engine.load_checkpoint(root, tag="odd")
        raise AssertionError("truncated file loaded")
    except CheckpointCorruptError as err:
        assert model_file in str(err) and f"rank {dist.get_rank()}" in str(err)
    try:
        engine.load_checkpoint(root, tag="missing_tag")
        raise AssertionError("missing tag loaded")
    except FileNotFoundError as err:
        assert "missing_tag" in str(err) and "rank" in str(err)
    engine.destroy()


def _module_only(root: str) -> None:
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=make_model(0), config=config("bf16", gas=1))
    train(engine, 0, 2)
    engine.save_checkpoint(root)
    saved = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    fresh, _, _, _ = deepspeed.initialize(model=make_model(3), config=config("bf16", gas=1))
    fresh.load_checkpoint(root, load_module_only=True)
    assert fresh.global_steps == 0
    train(fresh, 2, 3)  # the step must start from the loaded weights, not from stale fp32 masters
    moved = fresh.module.state_dict()
    diffs = [float((moved[k].float() - saved[k].float()).abs().max()) for k in saved]
    assert max(diffs) < 0.05, f"weights jumped after load_module_only: {max(diffs)}"
    fresh.destroy()


def _all_scenarios(root: str) -> bool:
    for precision in PRECISIONS:
        _resume_case(os.path.join(root, f"resume_{precision}"), precision)
    _layout_and_hf_expectations(os.path.join(root, "layout"))
    _safety_and_corruption(os.path.join(root, "safety"))
    _module_only(os.path.join(root, "module_only"))
    return True


def test_checkpoint_scenarios_world2(tmp_path: Path) -> None:
    assert run_distributed(_all_scenarios, 2, str(tmp_path)) == [True, True]


def _write_then_die(root: str, mode: str) -> None:
    """Save tag A (global_step2), then die inside the save of tag B (global_step3)."""
    import deepspeed
    from deepspeed._core.checkpoint import files as checkpoint_io

    engine, _, _, _ = deepspeed.initialize(model=make_model(0), config=config("fp32", gas=1))
    train(engine, 0, 2)
    engine.save_checkpoint(root, client_state={"phase": "A"})
    torch.save(engine.module.state_dict(), os.path.join(root, "reference_A.pt"))
    train(engine, 2, 3)
    if mode == "after_first_file":
        checkpoint_io.post_commit_hook = lambda path: os._exit(9)
    else:
        real_save = torch.save

        def torn_save(obj: object, f: object) -> None:
            real_save({"partial": torch.zeros(3)}, f)  # some bytes reach the temp file, then the process dies
            os._exit(9)

        torch.save = torn_save
    engine.save_checkpoint(root, client_state={"phase": "B"})


def _load_latest(root: str, reference: str) -> int:
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=make_model(9), config=config("fp32", gas=1))
    path, client = engine.load_checkpoint(root)
    assert path == os.path.join(root, "global_step2"), path
    want = torch.load(reference, weights_only=True)
    for k, v in engine.module.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert client["phase"] == "A"
    return engine.global_steps


def test_killed_writer_leaves_previous_tag_loadable(tmp_path: Path) -> None:
    for mode in ("after_first_file", "mid_write"):
        root = tmp_path / mode
        # The writer process exits abruptly (os._exit) in the middle of save_checkpoint.
        with pytest.raises(DistributedTestError, match="exited with code 9"):
            run_distributed(_write_then_die, 1, str(root), mode)
        assert (root / "latest").read_text() == "global_step2"
        tag_b = os.listdir(root / "global_step3")
        if mode == "after_first_file":
            assert tag_b == ["mp_rank_00_model_states.pt"]  # B's file is complete, but `latest` never moved
        else:
            assert not any(n.endswith("_states.pt") for n in tag_b)  # only the abandoned temp file
            assert any(".tmp-" in n for n in tag_b)
    # Fresh processes resume from A in both folders.
    assert run_distributed(_load_latest_both, 1, str(tmp_path)) == [[2, 2]]


def _load_latest_both(base: str) -> list[int]:
    return [
        _load_latest(os.path.join(base, m), os.path.join(base, m, "reference_A.pt"))
        for m in ("after_first_file", "mid_write")
    ]
