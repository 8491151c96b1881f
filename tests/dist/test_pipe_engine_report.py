"""The GPT-NeoX pipeline configuration of examples/ds_config_pipeline_neox.json, scaled down, through the pipeline engine (gloo, PP=2 x DP=2)."""

from __future__ import annotations

import torch

from tests._harness import run_distributed
from tests.dist._pipe_engine_models import layer_specs, loss_fn, pipe_config


def _module(interval: int) -> object:
    from deepspeed.runtime.pipe.module import PipelineModule

    return PipelineModule(
        layer_specs(),
        num_stages=2,
        loss_fn=loss_fn,
        seed_layers=True,
        seed_fn=torch.manual_seed,
        activation_checkpoint_interval=interval,
    )


def _report_configuration() -> dict:
    import deepspeed

    config = pipe_config(
        4,
        clip=1.0,
        stage=1,
        dp=2,
        zero={
            "allgather_bucket_size": 500,
            "reduce_bucket_size": 500,
            "overlap_comm": True,
            "reduce_scatter": True,
            "contiguous_gradients": True,
        },
        fp16={
            "enabled": True,
            "loss_scale": 0,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
            "initial_scale_power": 12,
        },
        activation_checkpointing={"partition_activations": True},
    )
    module = _module(1)
    deepspeed.checkpointing.configure(module.mpu(), deepspeed_config=config)
    tokens = torch.randint(0, 37, (48, 5), generator=torch.Generator().manual_seed(0))
    dataset = torch.utils.data.TensorDataset(tokens, tokens.roll(1, dims=1))
    engine, _, _, _ = deepspeed.initialize(model=module, config=config, training_data=dataset)
    peaks, losses = [], []
    for _ in range(4):
        losses.append(float(engine.train_batch()))  # the iterator over training_data
        peaks.append(engine._executor.last_run.buffers.ledger.peak)
    deepspeed.checkpointing.reset()
    return {
        "stage": engine.stage_id,
        "losses": losses,
        "peaks": peaks,
        "skipped": engine.skipped_steps,
        "scale": engine.optimizer.cur_scale,
        "steps": engine.global_steps,
    }


def test_report_configuration_pp2_dp2() -> None:
    results = run_distributed(_report_configuration, 4, timeout=300)
    for r in results:
        assert r["losses"] == results[0]["losses"]  # the data-parallel mean, broadcast to every stage
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        assert (r["skipped"], r["scale"], r["steps"]) == (results[0]["skipped"], results[0]["scale"], 4)
        assert r["skipped"] < 4
        assert max(r["peaks"]) == min(2 - r["stage"], 4)  # 1F1B's own bound, no growth with the window
