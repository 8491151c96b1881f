"""PipelineEngine composition (gloo, PP=2): activation checkpointing with partitioned activations and the grid as
mpu, LR schedulers, eval_batch; and bad input failing with a clear error on every rank, before any hang."""

from __future__ import annotations

import pytest
import torch

from tests._harness import run_distributed
from tests.dist._pipe_engine_models import (
    SequentialReference,
    data_iter,
    layer_specs,
    loss_fn,
    pipe_config,
    reference_name,
)
from tests.reference.models import micro_batch
from tests.reference.zero_oracle import reference_train

STEPS = 3


def _module(interval: int = 0, func: object = None, **kw: object) -> object:
    from deepspeed.runtime.pipe.module import PipelineModule

    return PipelineModule(
        layer_specs(),
        num_stages=2,
        loss_fn=loss_fn,
        seed_layers=True,
        seed_fn=torch.manual_seed,
        activation_checkpoint_interval=interval,
        activation_checkpoint_func=func,
        **kw,
    )


_CALLS = {"checkpoint": 0}


def _counting_checkpoint(function: object, *args: object) -> object:
    import deepspeed

    _CALLS["checkpoint"] += 1
    return deepspeed.checkpointing.checkpoint(function, *args)


def _activation_checkpointing() -> dict:
    import deepspeed

    out = {}
    for interval in (0, 1):
        config = pipe_config(2, stage=1, activation_checkpointing={"partition_activations": True})
        module = _module(interval, _counting_checkpoint if interval else None)
        deepspeed.checkpointing.configure(module.mpu(), deepspeed_config=config)
        engine, _, _, _ = deepspeed.initialize(model=module, config=config)
        it = data_iter(STEPS, 2, 1, 0)
        out[interval] = {
            "losses": [float(engine.train_batch(it)) for _ in range(STEPS)],
            "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
        }
        deepspeed.checkpointing.reset()
    out["calls"] = _CALLS["checkpoint"]
    return out


def test_activation_checkpointing_with_partitioned_activations_gives_the_same_training() -> None:
    results = run_distributed(_activation_checkpointing, 2, timeout=240)
    for r in results:
        assert r["calls"] > 0  # the checkpointed path really ran, on both stages
        assert r[1]["losses"] == r[0]["losses"]
        for name, value in r[1]["params"].items():
            torch.testing.assert_close(value, r[0]["params"][name], rtol=0, atol=1e-6)


def _lambda(step: int) -> float:
    return 1.0 / (step + 1)


def _scheduler_and_eval() -> dict:
    import deepspeed

    engine, _, _, sched = deepspeed.initialize(
        model=_module(), config=pipe_config(2), lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _lambda)
    )
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    evals = [
        engine.eval_batch(data_iter(1, 2, 1, 0)),
        engine.eval_batch(data_iter(1, 2, 1, 0), return_logits=True, num_micro_batches=1),
        engine.eval_batch(data_iter(1, 2, 1, 0), reduce_output=None),
    ]
    unchanged = all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
    engine.set_has_attention_mask(True)
    engine.set_train_batch_size(3 * 4)  # four micro-batches per batch ...
    assert engine.micro_batches == 4
    engine.set_train_batch_size(3 * 2)  # ... and back to two
    it = data_iter(STEPS, 2, 1, 0)
    losses, lrs = [], []
    for _ in range(STEPS):
        losses.append(float(engine.train_batch(it)))
        lrs.append(engine.get_lr()[0])
    return {
        "stage": engine.stage_id,
        "eval_avg": float(evals[0]),
        "eval_logits": evals[1][1],
        "eval_one": float(evals[1][0]),
        "eval_list": evals[2],
        "unchanged": unchanged,
        "steps": engine.global_steps,
        "losses": losses,
        "lrs": lrs,
        "boundary": engine.is_gradient_accumulation_boundary(),
        "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
    }


def test_lr_scheduler_and_eval_batch() -> None:
    results = run_distributed(_scheduler_and_eval, 2, timeout=240)
    ref = SequentialReference(layer_specs())
    with torch.no_grad():
        ref_eval = [float(ref(*micro_batch(0, m))) for m in range(2)]
    ref_losses = reference_train(
        ref, STEPS, 1, 2, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01), clip=0.5, lr_lambda=_lambda
    )
    ref_params = dict(ref.named_parameters())
    for r in results:
        last = r["stage"] == 1
        assert r["unchanged"] and r["steps"] == STEPS and not r["boundary"]
        assert r["eval_avg"] == pytest.approx(sum(ref_eval) / 2, rel=1e-6)
        assert r["eval_one"] == pytest.approx(ref_eval[0], rel=1e-6)
        if last:
            assert tuple(r["eval_logits"].shape) == (3, 5, 37)
            assert [float(x) for x in r["eval_list"]] == pytest.approx(ref_eval, rel=1e-6)
        else:
            assert r["eval_logits"] is None and r["eval_list"] is None
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
        assert r["lrs"] == pytest.approx([1e-2 * _lambda(s + 1) for s in range(STEPS)])
        for name, value in r["params"].items():
            torch.testing.assert_close(value, ref_params[reference_name(name)].detach(), rtol=1e-5, atol=1e-5)


# --- bad input: the same clear error on every rank, no hang --------------------------------------------------------
def _bad_inputs(cases: list[str]) -> dict[str, str]:
    """Every case in one spawn: each fails identically on every rank, so the process group stays usable."""
    return {case: _bad_input(case) for case in cases}


def _bad_input(case: str) -> str:
    import deepspeed
    from deepspeed.runtime.pipe.module import PipelineModule

    try:
        if case == "zero2":
            deepspeed.initialize(model=_module(), config=pipe_config(1, stage=2))
        elif case == "zero3":
            deepspeed.initialize(model=_module(), config=pipe_config(1, stage=3))
        elif case == "stages":
            PipelineModule(layer_specs(), num_stages=3, loss_fn=loss_fn)
        elif case == "pipeline_block":
            model = torch.nn.Linear(3, 3)
            deepspeed.initialize(model=model, config={**pipe_config(1, dp=2), "pipeline": {"stages": 2}})
        elif case == "mpu":
            module = _module()
            deepspeed.initialize(model=module, config=pipe_config(1), mpu=module.mpu())
        elif case in ("data", "data_one_stage", "data_late"):
            engine, _, _, _ = deepspeed.initialize(model=_module(), config=pipe_config(2))
            bad = iter([torch.zeros(3, 5, dtype=torch.long)] * 4)
            good = data_iter(1, 2, 1, 0)
            if case == "data_late":  # the second micro-batch is wrong, on the last stage only
                bad = iter([micro_batch(0, 0), (micro_batch(0, 1)[0],)])
            engine.train_batch(bad if case == "data" or engine.is_first_stage() != (case == "data_late") else good)
        elif case == "direct_calls":
            engine, _, _, _ = deepspeed.initialize(model=_module(), config=pipe_config(1))
            messages = []
            for call in (lambda: engine(torch.zeros(1)), lambda: engine.backward(torch.zeros(())), engine.step):
                try:
                    call()
                except Exception as err:  # noqa: BLE001 - the type is checked by the test
                    messages.append(f"{type(err).__name__}: {err}")
            return " | ".join(messages)
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return "no error"


BAD_INPUT_CASES = [
    "zero2",
    "zero3",
    "stages",
    "pipeline_block",
    "mpu",
    "data",
    "data_one_stage",
    "data_late",
    "direct_calls",
]


@pytest.fixture(scope="module")
def bad_input_messages() -> list[dict]:
    return run_distributed(_bad_inputs, 2, BAD_INPUT_CASES, timeout=180)


@pytest.mark.parametrize(
    "case, expected",
    [
        ("zero2", "DeepSpeedConfigError: zero_optimization.stage=2 cannot be combined with pipeline parallelism"),
        ("zero3", "DeepSpeedConfigError: zero_optimization.stage=3 cannot be combined with pipeline parallelism"),
        ("stages", "num_stages"),
        ("pipeline_block", "DeepSpeedConfigError: the config sets 'pipeline' but the model is a Linear"),
        ("mpu", "AssertionError: mpu must be None with pipeline parallelism"),
        (
            "data",
            "ValueError: pipeline data on rank 0: ValueError: a pipeline data iterator must yield (inputs, labels)",
        ),
        ("data_one_stage", "ValueError: pipeline data on rank 0: ValueError: a pipeline data iterator must yield"),
        (
            "data_late",
            "ValueError: pipeline data on rank 1: ValueError: a pipeline data iterator must yield (inputs, "
            "labels) pairs (inputs: a tensor or a tuple of tensors for the first stage; labels: what loss_fn "
            "takes on the last stage); got a tuple of length 1",
        ),
        (
            "direct_calls",
            "PipelineError: Only train_batch() is accessible in pipeline mode. | PipelineError: Only "
            "train_batch() is accessible in pipeline mode. | PipelineError: Only train_batch() is "
            "accessible in pipeline mode.",
        ),
    ],
)
def test_bad_input_fails_on_every_rank(case: str, expected: str, bad_input_messages: list[dict]) -> None:
    for rank, messages in enumerate(bad_input_messages):
        assert expected in messages[case], f"rank {rank}: {messages[case]}"
