"""Torch-only optimizers (FusedAdam's fallback, Adagrad, Lion) against torch or a float64 reference."""

from __future__ import annotations

import pytest
import torch

from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed.ops.adam import FusedAdam
from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

SIZES = (1001, 3, 1)


def _data(seed: int, steps: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    return (
        [torch.randn(n, generator=gen) for n in SIZES],
        [[torch.randn(n, generator=gen) for n in SIZES] for _ in range(steps)],
    )


def _run(opt_factory: object, params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = opt_factory(ps)  # type: ignore[operator]
    for step_grads in grads:
        for p, g in zip(ps, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps]


def _max_rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(
        ((x.double() - y.double()).abs().max() / y.double().abs().max()).item() for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_fused_adam_cpu_fallback_matches_torch(adam_w_mode: bool, wd: float) -> None:
    params, grads = _data(1, 100)
    ours = _run(lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=wd, adam_w_mode=adam_w_mode), params, grads)
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref = _run(lambda ps: cls(ps, lr=1e-3, weight_decay=wd, foreach=False), params, grads)
    assert _max_rel(ours, ref) <= 1e-6


def test_fused_adam_contract() -> None:
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam([torch.nn.Parameter(torch.zeros(2))], amsgrad=True)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = FusedAdam([p], set_grad_none=True)
    p.grad = torch.ones(2)
    opt.step()
    assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
    opt.zero_grad()
    assert p.grad is None


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_cpu_adagrad_matches_torch(wd: float) -> None:
    params, grads = _data(2, 100)
    ours = _run(lambda ps: DeepSpeedCPUAdagrad(ps, lr=1e-2, weight_decay=wd), params, grads)
    ref = _run(lambda ps: torch.optim.Adagrad(ps, lr=1e-2, weight_decay=wd, eps=1e-10, foreach=False), params, grads)
    assert _max_rel(ours, ref) <= 1e-6


def _lion_fp64(
    params: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    lr: float,
    wd: float,
    betas: tuple[float, float] = (0.9, 0.999),
) -> list[torch.Tensor]:
    out = []
    for i, p0 in enumerate(params):
        p, m = p0.double().clone(), torch.zeros_like(p0, dtype=torch.float64)
        for step_grads in grads:
            g = step_grads[i].double()
            p = p * (1 - lr * wd) - lr * torch.sign(betas[0] * m + (1 - betas[0]) * g)
            m = betas[1] * m + (1 - betas[1]) * g
        out.append(p)
    return out


@pytest.mark.parametrize("cls", [DeepSpeedCPULion, FusedLion])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lion_matches_reference(cls: type, wd: float) -> None:
    params, grads = _data(3, 100)
    ours = _run(lambda ps: cls(ps, lr=1e-3, weight_decay=wd), params, grads)
    assert _max_rel(ours, _lion_fp64(params, grads, 1e-3, wd)) <= 1e-5


def test_state_keys_and_fp32_states_for_bf16() -> None:
    p = torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16))
    opts = [DeepSpeedCPUAdagrad([p]), DeepSpeedCPULion([p])]
    p.grad = torch.randn_like(p)
    for opt in opts:
        opt.step()
    assert set(opts[0].state[p]) == {"step", "exp_avg_sq"} and opts[0].state[p]["exp_avg_sq"].dtype == torch.float32
    assert set(opts[1].state[p]) == {"step", "exp_avg"} and opts[1].state[p]["exp_avg"].dtype == torch.float32
