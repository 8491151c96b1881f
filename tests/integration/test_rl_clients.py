"""The calls RL libraries make, on 2 gloo ranks, each checked against a plain single-process PyTorch reference.

* TRL's ``prepare_deepspeed``: the accelerate config is copied, ``"zero_optimization.*"`` dotted keys are added at
  the top level and ``"auto"`` values are left in place, then passed straight to ``deepspeed.initialize``. Upstream
  ignores the dotted keys (they are not nested keys); so do we, with one warning naming them. A stage-0 reference
  model sits beside a ZeRO-3 policy; ``GatheredParameters(model.parameters())`` wraps generation.
* OpenRLHF's weight sync: one ``GatheredParameters([p])`` per parameter, ``p.data`` broadcast over a second group;
  only that one parameter is ever gathered. ``offload_states`` / ``reload_states`` bracket the generation phase.
* The attributes they read: ``deepspeed.version``, ``deepspeed.__version__``, ``isinstance(m, DeepSpeedEngine)``,
  ``engine.config["zero_optimization"][...]``, ``engine.optimizer`` an instance of the public class for its stage.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import deepspeed
from deepspeed import comm as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

VOCAB, HIDDEN, MICRO, LR = 29, 12, 2, 0.05


class TinyCausalLM(nn.Module):
    """Embedding, one residual MLP, head: ``forward(tokens) -> logits``; enough to train and to decode."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(h + self.mlp(h))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _model() -> TinyCausalLM:
    torch.manual_seed(0)
    return TinyCausalLM()


def _batch(world: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (world * MICRO, 7), generator=torch.Generator().manual_seed(100 + step))


def _greedy(model: nn.Module, prompt: torch.Tensor, new_tokens: int = 5) -> torch.Tensor:
    tokens = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            tokens = torch.cat([tokens, model(tokens)[:, -1:].argmax(-1)], dim=1)
    return tokens


def _accelerate_style_config(stage: int) -> dict:
    """What ``accelerator.state.deepspeed_plugin.deepspeed_config`` holds after ``prepare``: some "auto" left."""
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "train_batch_size": "auto",
        "gradient_accumulation_steps": 1,
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": 0,
        },
    }


def _prepare_deepspeed(model: nn.Module, config: dict) -> deepspeed.DeepSpeedEngine:
    """TRL's ``prepare_deepspeed`` for a frozen reference model, as it is written."""
    config_kwargs = copy.deepcopy(config)
    stage = config_kwargs["zero_optimization"]["stage"]
    if stage == 3:
        config_kwargs.update(
            {
                "zero_optimization.reduce_bucket_size": HIDDEN * HIDDEN,
                "zero_optimization.stage3_param_persistence_threshold": 10 * HIDDEN,
                "zero_optimization.stage3_prefetch_bucket_size": 0.9 * HIDDEN * HIDDEN,
            }
        )
    if stage != 3:
        config_kwargs["zero_optimization"]["stage"] = 0
    config_kwargs.pop("optimizer")
    engine, *_ = deepspeed.initialize(model=model, config=config_kwargs)
    engine.eval()
    return engine


def _train_reference(steps: int, world: int) -> nn.Module:
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(steps):
        opt.zero_grad()
        _loss(ref, _batch(world, step)).backward()
        opt.step()
    return ref


def _engine_step(engine: deepspeed.DeepSpeedEngine, step: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = _batch(world, step)[rank * MICRO : (rank + 1) * MICRO]
    engine.backward(_loss(engine, tokens))
    engine.step()


@pytest.mark.world_size(2)
def test_trl_reference_model_beside_zero3_policy() -> None:
    policy, *_ = deepspeed.initialize(model=_model(), config=_accelerate_style_config(3))
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(handler)
    try:
        ref_zero3 = _prepare_deepspeed(_model(), _accelerate_style_config(3))
    finally:
        logger.removeHandler(handler)
    dotted = [r.getMessage() for r in records if "zero_optimization.reduce_bucket_size" in r.getMessage()]
    # The unknown-key warning is printed once per run, by rank 0.
    if dist.get_rank() == 0:
        assert dotted, "the dotted top-level keys must be named in a warning, not dropped silently"
    else:
        assert not dotted, "only rank 0 names unknown top-level keys"
    # Upstream does not read dotted top-level keys: the block's values stay in force.
    assert ref_zero3.config["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert ref_zero3.zero_optimization_stage() == 3
    ref_stage0 = _prepare_deepspeed(_model(), _accelerate_style_config(2))
    assert ref_stage0.zero_optimization_stage() == 0 and ref_stage0.optimizer is None
    _engine_step(policy, 0)

    expected = _train_reference(1, dist.get_world_size())
    prompt = _batch(1, 9)[:, :3]
    with deepspeed.zero.GatheredParameters(policy.module.parameters()):
        generated = _greedy(policy.module, prompt)
    assert torch.equal(generated, _greedy(expected, prompt))
    frozen = _model()
    with torch.no_grad():
        torch.testing.assert_close(ref_stage0(prompt), frozen(prompt), rtol=0, atol=0)
        torch.testing.assert_close(ref_zero3(prompt), frozen(prompt), rtol=1e-6, atol=1e-6)
    for engine in (policy, ref_zero3, ref_stage0):
        engine.destroy()


def _gathered_numel(module: nn.Module) -> int:
    return sum(p.data.numel() for p in module.parameters() if p.ds_status == ZeroParamStatus.AVAILABLE)


@pytest.mark.world_size(2)
def test_openrlhf_weight_sync_one_parameter_at_a_time() -> None:
    engine, *_ = deepspeed.initialize(model=_model(), config=_accelerate_style_config(3))
    assert isinstance(engine, deepspeed.DeepSpeedEngine)
    assert engine.config["zero_optimization"]["stage"] == 3
    assert deepspeed.version == deepspeed.__version__ and deepspeed.__version__.startswith("0.")
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    assert isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)
    _engine_step(engine, 0)
    # The "inference engine" lives on rank 1 and receives weights over its own group, as vLLM workers do.
    sync_group = dist.new_group([0, 1])
    receiver = _model() if dist.get_rank() == 1 else None
    received = dict(receiver.named_parameters()) if receiver is not None else {}
    largest = max(p.ds_numel for p in engine.module.parameters())
    held = []
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            held.append(_gathered_numel(engine.module))
            buffer = param.data.clone() if dist.get_rank() == 0 else received[name].data
            dist.broadcast(buffer, src=0, group=sync_group)
    assert held == [p.ds_numel for p in engine.module.parameters()]  # never more than the one parameter
    assert max(held) == largest < sum(p.ds_numel for p in engine.module.parameters())
    assert _gathered_numel(engine.module) == 0
    expected = _train_reference(1, dist.get_world_size())
    if receiver is not None:
        for (name, got), want in zip(receiver.named_parameters(), expected.parameters(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)

    engine.offload_states()  # generation phase: the optimizer's memory is not needed
    engine.reload_states()
    _engine_step(engine, 1)
    expected = _train_reference(2, dist.get_world_size())
    with deepspeed.zero.GatheredParameters(engine.module.parameters()):
        for got, want in zip(engine.module.parameters(), expected.parameters(), strict=True):
            torch.testing.assert_close(got.detach(), want, rtol=1e-6, atol=1e-7)
    engine.destroy()


@pytest.mark.world_size(2)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_optimizer_is_the_public_class(stage: int) -> None:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    engine, *_ = deepspeed.initialize(model=_model(), config=_accelerate_style_config(stage))
    assert isinstance(engine.optimizer, DeepSpeedZeroOptimizer)
    assert engine.optimizer.partition_gradients is (stage == 2)
    assert engine.optimizer.partition_count == [2] * len(engine.optimizer.bit16_groups)
    _engine_step(engine, 0)
    from deepspeed.utils import safe_get_full_fp32_param

    for param, want in zip(engine.module.parameters(), _train_reference(1, 2).parameters(), strict=True):
        torch.testing.assert_close(safe_get_full_fp32_param(param).reshape(want.shape), want, rtol=1e-6, atol=1e-7)
    engine.destroy()
