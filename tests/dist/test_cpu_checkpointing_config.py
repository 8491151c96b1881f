"""``activation_checkpointing.cpu_checkpointing`` at ``deepspeed.initialize``: refused without checkpointing (on
every rank, before any collective), accepted with it."""

from __future__ import annotations

from tests._harness import run_distributed
from tests.reference.models import make_model

CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "activation_checkpointing": {"cpu_checkpointing": True},
}


def _initialize(configure_first: bool) -> str:
    import deepspeed
    from deepspeed._core.engine import activation_checkpoint as core

    core._STATE = core.ActivationCheckpointState()  # a fresh process-wide state in this rank
    if configure_first:
        deepspeed.checkpointing.configure(None, deepspeed_config=CONFIG)
    try:
        engine = deepspeed.initialize(model=make_model(0), config=CONFIG)[0]
    except ValueError as err:
        return str(err)
    assert core.current_state().policy.checkpoint_in_cpu
    engine.destroy()
    return "ok"


def test_cpu_checkpointing_without_checkpointing_is_refused_on_every_rank() -> None:
    for message in run_distributed(_initialize, 2, False):
        assert "activation_checkpointing.cpu_checkpointing=true" in message
        assert "not in use" in message and "deepspeed.checkpointing.configure" in message


def test_cpu_checkpointing_with_configured_checkpointing_is_accepted() -> None:
    assert run_distributed(_initialize, 1, True) == ["ok"]
