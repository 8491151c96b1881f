"""``deepspeed.utils.safe_get_full_*`` / ``safe_set_full_*`` on ZeRO-1/2 (world 2) and stage 0.

Oracles: the fp32 masters gathered independently from every rank's partition (ZeRO-1/2), the working
weights after a publish, and gradients recomputed on an unsharded copy of the model and averaged
over the ranks.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch


def _config(stage: int, **extra: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 500},
        **extra,
    }


def _ensure_mapped(engine) -> None:
    """Attach the mappings if this build's optimizer constructor does not do it yet (idempotent)."""
    from deepspeed._core.optim.hp_mapping import attach_hp_mapping

    if not all(hasattr(p, "_hp_mapping") for p in engine.module.parameters() if p.requires_grad):
        attach_hp_mapping(engine.optimizer)


def _gathered_masters(opt, key: str | None = None) -> dict[int, torch.Tensor]:
    """Independent oracle: all-gather every group's fp32 partitions, slice out each parameter."""
    from deepspeed import comm as dist

    out = {}
    for group in opt.groups:
        master = group.master.param
        mine = master.data if key is None else opt.optimizer.state[master][key]
        parts = [torch.empty_like(mine) for _ in range(opt.world_size)]
        dist.all_gather(parts, mine.contiguous(), group=opt.dp_group)
        flat = torch.cat(parts)
        for slot, p in zip(group.flat.layout.slots, group.params):
            out[id(p)] = flat[slot.range.as_slice()].view(slot.shape)
    return out


def _reference_grads(model: torch.nn.Module, batch: tuple) -> dict[str, torch.Tensor]:
    """Gradients of the unsharded model on this rank's batch, averaged over the ranks."""
    from deepspeed import comm as dist

    model.zero_grad()
    model(*batch).backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g)
        grads[name] = g / dist.get_world_size()
    return grads


def _check_zero(stage: int, dtype_block: dict) -> None:
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.utils.tensor_fragment import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_grad,
    )

    model = make_model(0)
    reference = copy.deepcopy(model)
    engine = deepspeed.initialize(model=model, config=_config(stage, **dtype_block))[0]
    _ensure_mapped(engine)
    opt = engine.optimizer
    params = dict(engine.module.named_parameters())
    batch = micro_batch(0, dist.get_rank())

    # Gradients exist (as partition gradients) between backward and step; .grad is already freed.
    engine.backward(engine(*batch))
    expected = _reference_grads(reference, batch)
    tol = 1e-5 if not dtype_block else 5e-2
    for name, p in params.items():
        assert p.grad is None, name
        grad = safe_get_full_grad(p)
        assert grad.shape == p.shape and grad.dtype == torch.float32, name
        torch.testing.assert_close(grad, expected[name], rtol=tol, atol=tol)
    # A local write lands in the owners' fragments and reads back whole.
    probe = params["fc2.bias"]
    new_grad = torch.arange(probe.numel(), dtype=torch.float32).view(probe.shape)
    safe_set_full_grad(probe, new_grad)
    torch.testing.assert_close(safe_get_full_grad(probe), new_grad)
    engine.step()
    with pytest.raises(ValueError, match="between a backward and the optimizer step"):
        safe_get_full_grad(probe)

    masters, moments = _gathered_masters(opt), _gathered_masters(opt, "exp_avg")
    for name, p in params.items():
        full = safe_get_full_fp32_param(p)
        assert full.dtype == torch.float32 and full.shape == p.shape, name
        torch.testing.assert_close(full, masters[id(p)], rtol=0, atol=0)
        torch.testing.assert_close(full.to(p.dtype), p.data, rtol=0, atol=0)  # published after the step
        state = safe_get_full_optimizer_state(p, "exp_avg")
        assert state.shape == p.shape and state.abs().sum() > 0, name
        torch.testing.assert_close(state, moments[id(p)], rtol=0, atol=0)
    with pytest.raises(ValueError, match="no_such_state"):
        safe_get_full_optimizer_state(probe, "no_such_state")

    # Set → get round trip; the working weights follow at the next publish.
    target = {name: torch.full(p.shape, 0.25 + i, dtype=torch.float32) for i, (name, p) in enumerate(params.items())}
    for name, p in params.items():
        safe_set_full_fp32_param(p, target[name])
    for name, p in params.items():
        torch.testing.assert_close(safe_get_full_fp32_param(p), target[name], rtol=0, atol=0)
    assert not torch.equal(params["fc1.weight"].data, target["fc1.weight"].to(params["fc1.weight"].dtype))
    opt.publish_weights()
    for name, p in params.items():
        torch.testing.assert_close(p.data, target[name].to(p.dtype), rtol=0, atol=0)
    assert safe_get_full_fp32_param(torch.nn.Parameter(torch.zeros(3))) is None

    # The mappings do not keep the optimizer alive: once the engine is gone, so are the fp32 masters,
    # and the model's parameters read as unmanaged.
    master_ref = weakref.ref(opt.groups[0].master.param)
    engine.destroy()
    del engine, opt
    gc.collect()
    assert master_ref() is None
    assert safe_get_full_fp32_param(probe) is None


def _check_stage0() -> None:
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.utils.tensor_fragment import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_set_full_fp32_param,
    )

    model = make_model(0)
    engine, *_ = deepspeed.initialize(model=model, config=_config(0))
    _ensure_mapped(engine)
    p = engine.module.fc1.weight
    engine.backward(engine(*micro_batch(0, dist.get_rank())))
    assert safe_get_full_grad(p) is p.grad  # autograd's gradient is returned as is
    engine.step()
    torch.testing.assert_close(safe_get_full_fp32_param(p), p.data, rtol=0, atol=0)
    assert safe_get_full_fp32_param(p).data_ptr() != p.data_ptr()  # a copy, not an alias
    assert safe_get_full_optimizer_state(p, "exp_avg").shape == p.shape
    value = torch.full(p.shape, 3.0)
    safe_set_full_fp32_param(p, value)
    torch.testing.assert_close(p.data, value, rtol=0, atol=0)  # no separate master in fp32 stage 0
    with pytest.raises(AssertionError, match="ZeRO-3"):
        safe_get_local_fp32_param(p)
    engine.destroy()


def _all_cases() -> None:
    for stage in (1, 2):
        _check_zero(stage, {})
    _check_zero(2, {"bf16": {"enabled": True}})
    _check_stage0()


def test_safe_get_set_world2() -> None:
    run_distributed(_all_cases, 2)
