"""HF ``Trainer`` runs ``examples/hf_trainer.py`` on our engine through the ``deepspeed`` launcher (2 CPU ranks).

Per ZeRO stage (module-scoped fixture): one run of 6 optimizer steps (micro-batch 4, GAS 2) with the example's
HF-style JSON full of ``"auto"`` values, saving ``checkpoint-3`` and ``checkpoint-6``; then a second launcher run
with ``--resume_from_checkpoint checkpoint-3`` that must continue at step 4 and reproduce steps 4-6 exactly.
Under ZeRO-3 the model is built by ``AutoModelForCausalLM.from_config`` inside ``deepspeed.zero.Init`` (transformers
does that once ``TrainingArguments(deepspeed=<zero3 json>)`` exists).
"""

from __future__ import annotations

import json
import math
import os

import pytest

from tests.integration._common import ZERO2_AUTO, ZERO3_AUTO, losses_by_step, missing_integration_packages, run_launcher

pytestmark = pytest.mark.skipif(missing_integration_packages() is not None, reason=missing_integration_packages() or "")

STAGES = {2: ZERO2_AUTO, 3: ZERO3_AUTO}
STEPS, SAVE_EVERY, MICRO, GAS, HIDDEN = 6, 3, 4, 2, 32


def _args(config: str, out_dir: str) -> list[str]:
    return [
        "--deepspeed",
        config,
        "--output_dir",
        out_dir,
        "--max_steps",
        str(STEPS),
        "--save_strategy",
        "steps",
        "--save_steps",
        str(SAVE_EVERY),
        "--per_device_train_batch_size",
        str(MICRO),
        "--gradient_accumulation_steps",
        str(GAS),
        "--n_embd",
        str(HIDDEN),
    ]


@pytest.fixture(scope="module", params=sorted(STAGES), ids=lambda stage: f"zero{stage}")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Train (saving checkpoints), then resume from the first checkpoint in a second launcher run."""
    stage = request.param
    out_dir = str(tmp_path_factory.mktemp(f"hf_trainer_zero{stage}"))
    first, _ = run_launcher(_args(str(STAGES[stage]), out_dir))
    resume_from = os.path.join(out_dir, f"checkpoint-{SAVE_EVERY}")
    # The resumed run writes elsewhere so that the first run's checkpoints stay as they were.
    second, _ = run_launcher(
        _args(str(STAGES[stage]), out_dir + "_resumed") + ["--resume_from_checkpoint", resume_from]
    )
    return {"stage": stage, "first": first, "second": second, "out_dir": out_dir}


def test_trains_and_loss_decreases(runs: dict) -> None:
    """Our engine ran the requested stage on 2 ranks for every step, and the loss went down."""
    first = runs["first"]
    assert first["engine"] == "deepspeed.runtime.engine.DeepSpeedEngine"
    assert first["zero_stage"] == runs["stage"] and first["world_size"] == 2
    assert first["global_step"] == STEPS and first["engine_global_steps"] == STEPS
    assert first["zero_init"] == (runs["stage"] == 3)
    losses = losses_by_step(first)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(math.isfinite(loss) for loss in losses.values())
    assert losses[STEPS] < losses[1] - 0.1, losses


def test_auto_values_filled(runs: dict) -> None:
    """Trainer replaced every "auto" from TrainingArguments and the model before the engine saw the config."""
    config = runs["first"]["ds_config"]
    assert "auto" not in json.dumps(config)
    assert config["train_micro_batch_size_per_gpu"] == MICRO
    assert config["gradient_accumulation_steps"] == GAS
    assert config["train_batch_size"] == MICRO * GAS * 2
    assert config["zero_optimization"]["reduce_bucket_size"] == HIDDEN * HIDDEN
    assert config["scheduler"]["params"]["total_num_steps"] == STEPS
    assert config["optimizer"]["params"]["lr"] == pytest.approx(1e-2)  # the example's default learning rate
    if runs["stage"] == 3:
        assert config["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * HIDDEN * HIDDEN)
        assert config["zero_optimization"]["stage3_param_persistence_threshold"] == 10 * HIDDEN


def test_checkpoint_layout(runs: dict) -> None:
    """``checkpoint-N/global_stepN`` folders in upstream's layout, ``latest``, and full saved weights."""
    from safetensors.torch import load_file

    for step in (SAVE_EVERY, STEPS):
        ckpt = os.path.join(runs["out_dir"], f"checkpoint-{step}")
        with open(os.path.join(ckpt, "latest")) as fd:
            assert fd.read().strip() == f"global_step{step}"
        files = set(os.listdir(os.path.join(ckpt, f"global_step{step}")))
        optim = {f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in range(2)}
        if runs["stage"] == 3:
            model = {f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" for rank in range(2)}
        else:
            model = {"mp_rank_00_model_states.pt"}
        assert optim | model <= files, files
        with open(os.path.join(ckpt, "trainer_state.json")) as fd:
            assert json.load(fd)["global_step"] == step
        weights = load_file(os.path.join(ckpt, "model.safetensors"))  # ZeRO-3: gathered 16-bit weights
        assert weights["transformer.wte.weight"].shape == (100, HIDDEN)
        assert all(t.numel() > 0 and bool(t.isfinite().all()) for t in weights.values())


def test_resume_continues_at_the_right_step(runs: dict) -> None:
    """The resumed run starts at step 3, ends at 6, and reproduces the first run's losses for steps 4-6."""
    first, second = runs["first"], runs["second"]
    assert second["start_step"] == SAVE_EVERY
    assert second["global_step"] == STEPS and second["engine_global_steps"] == STEPS
    resumed, original = losses_by_step(second), losses_by_step(first)
    assert sorted(resumed) == list(range(SAVE_EVERY + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(original[step], rel=1e-5, abs=1e-6), (step, resumed, original)
