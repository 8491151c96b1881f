"""accelerate drives our engine exactly as it drives upstream DeepSpeed (2 CPU ranks over gloo).

One run per ZeRO stage (module-scoped fixture, then several tests read it):
``Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=<examples/*_auto.json>))`` with
``DummyOptim``/``DummyScheduler``; 6 optimizer steps of 2 micro-batches through ``accelerator.accumulate`` (so
the engine sees ``set_gradient_accumulation_boundary(is_boundary=False/True)`` and ``step()`` only at the
boundary), ``save_state`` after step 3, ``free_memory`` at the end. A second, fresh pair of ranks
``load_state``s the step-3 checkpoint and must reproduce steps 4-6.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tests._harness import run_distributed
from tests.integration._common import QUIET_ENV, ZERO2_AUTO, ZERO3_AUTO, missing_integration_packages

pytestmark = pytest.mark.skipif(missing_integration_packages() is not None, reason=missing_integration_packages() or "")

GAS, STEPS, SAVE_AT = 2, 6, 3
TIMEOUT = 240.0
STAGES = {2: ZERO2_AUTO, 3: ZERO3_AUTO}


def accelerate_config(example: Path, out_dir: Path) -> str:
    """The example's HF-style config with concrete ``betas``/``eps``: outside the Trainer, accelerate fills only
    batch sizes, GAS, clipping, lr/weight decay, scheduler and hidden-size entries, and rejects other "auto"s."""
    config = json.loads(example.read_text())
    config["optimizer"]["params"].update(betas=[0.9, 0.999], eps=1e-8)
    path = out_dir / example.name
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module", params=sorted(STAGES), ids=lambda stage: f"zero{stage}")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Train + save + teardown in one pair of ranks, then resume in a fresh pair; return both ranks' reports."""
    from tests.integration import _accelerate_job as job

    stage = request.param
    config = accelerate_config(STAGES[stage], tmp_path_factory.mktemp(f"accelerate_config{stage}"))
    save_dir = str(tmp_path_factory.mktemp(f"accelerate_zero{stage}"))
    first = run_distributed(
        job.train_save_and_teardown, 2, config, save_dir, GAS, STEPS, SAVE_AT, timeout=TIMEOUT, env=QUIET_ENV
    )
    second = run_distributed(job.resume, 2, config, save_dir, GAS, STEPS, SAVE_AT, timeout=TIMEOUT, env=QUIET_ENV)
    return {"stage": stage, "first": first, "second": second, "save_dir": save_dir}


def test_auto_values_filled_and_loss_decreases(runs: dict) -> None:
    """accelerate filled the "auto" entries; the engine runs the requested stage and GAS; loss goes down."""
    report = runs["first"][0]
    config = report["config"]
    assert report["stage"] == runs["stage"]
    assert report["zero_init"] == (runs["stage"] == 3)  # transformers built the ZeRO-3 model inside zero.Init
    assert report["gas"] == GAS
    assert config["train_micro_batch_size_per_gpu"] == 4
    assert config["train_batch_size"] == 4 * GAS * 2
    assert config["optimizer"]["params"]["lr"] == pytest.approx(1e-2)
    assert config["scheduler"]["params"]["warmup_num_steps"] == 2
    assert config["zero_optimization"]["reduce_bucket_size"] == 32 * 32  # hidden_size ** 2
    for rank_report in runs["first"]:
        losses = rank_report["loss"]
        assert all(math.isfinite(loss) for loss in losses)
        assert losses[-1] < losses[0] - 0.1, losses


def test_boundary_calls_step_once_per_accumulation_window(runs: dict) -> None:
    """With accelerate's boundary calls, ``global_steps`` advances once per GAS micro-batches, never in between."""
    for rank_report in runs["first"]:
        assert rank_report["global_steps"] == list(range(1, STEPS + 1))
        assert rank_report["micro_size"] == (4 * GAS, 16)


def test_accumulation_matches_one_large_micro_batch(runs: dict) -> None:
    """Two accumulated micro-batches of 4 give the gradients (norms) and losses of one micro-batch of 8 driven
    through a plain ``engine.backward``/``engine.step`` loop: the non-boundary micro-batch is not lost."""
    for rank_report in runs["first"]:
        assert rank_report["grad_norm"] == pytest.approx(rank_report["ref_grad_norm"], rel=1e-4, abs=1e-6)
        assert rank_report["loss"] == pytest.approx(rank_report["ref_loss"], rel=1e-4, abs=1e-5)


def test_save_state_layout(runs: dict) -> None:
    """``save_state`` wrote an engine checkpoint under the ``pytorch_model`` tag (accelerate's ckpt id)."""
    tag_dir = os.path.join(runs["save_dir"], "pytorch_model")
    files = sorted(os.listdir(tag_dir))
    with open(os.path.join(runs["save_dir"], "latest")) as fd:
        assert fd.read().strip() == "pytorch_model"
    optim = [f for f in files if f.endswith("_optim_states.pt")]
    assert len(optim) == 2, files  # one optimizer shard per rank
    model_states = [f for f in files if f.endswith("model_states.pt")]
    assert model_states, files


def test_load_state_resumes_exactly(runs: dict) -> None:
    """A fresh run that ``load_state``s the step-3 checkpoint continues at step 4 and reproduces steps 4-6."""
    for first, second in zip(runs["first"], runs["second"], strict=True):
        assert second["loaded_steps"] == SAVE_AT
        assert second["global_steps"] == list(range(SAVE_AT + 1, STEPS + 1))
        assert second["loss"] == pytest.approx(first["loss"][SAVE_AT:], rel=1e-5, abs=1e-6)
        assert second["grad_norm"] == pytest.approx(first["grad_norm"][SAVE_AT:], rel=1e-4, abs=1e-6)


def test_free_memory_destroys_engine(runs: dict) -> None:
    """``accelerator.free_memory()`` calls ``engine.destroy()``: the optimizer and scheduler are dropped and no
    ZeRO gradient hook remains (a plain backward on the module keeps its ``.grad``s)."""
    for rank_report in runs["first"]:
        destroy = rank_report["destroy"]
        assert destroy["wrapper_cleared"] and destroy["models_left"] == 0
        assert destroy["optimizer"] is None and destroy["lr_scheduler"] is None
        if runs["stage"] < 3:  # gradient hooks: a plain backward after destroy keeps every .grad
            assert destroy["grads_kept"]
        else:  # module fetch/release hooks: all removed
            assert destroy["hooks_before"] > 0 and destroy["hooks_after"] == 0, destroy
