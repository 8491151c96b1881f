"""The ZeRO step decided on the device ([Note: device step] in ``deepspeed/_core/optim/sharded.py``).

With an optimizer that skips on a device flag (torch's fused AdamW) the global norm, the clip coefficient and
the overflow decision stay on the device: the host reads them once, after every update of the step is queued.
Checked at world sizes 1 and 2 for ZeRO-1, 2 and 3, against the same run decided on the host: identical weights,
norms, skip counts and learning rates, an overflow on one rank skipped everywhere without advancing the
optimizer's step count, and no host read of a tensor before the last update is issued.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch
from tests.reference.zero_oracle import engine_micro_index, reference_train

STEPS = 3
INF_STEP = 1  # the last rank's gradient of this step holds an inf
LR = 1e-2


def _config(stage: int, bf16: bool) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.05,  # below the tiny model's norm: every step is clipped
        "zero_allow_untested_optimizer": True,  # FlagSGD
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0},
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


class FlagSGD(torch.optim.Optimizer):
    """Plain SGD that skips on a device ``found_inf`` flag and counts steps on the host, as ``FusedAdam`` does on
    CUDA: the engine must put a skipped step's count back (and drop state the skipped step created)."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    def skips_on_found_inf(self) -> bool:
        return True

    @torch.no_grad()
    def step(self, closure=None):
        flag = getattr(self, "found_inf", None)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["step"] = state.get("step", 0) + 1
                    update = p.grad * group["lr"]
                    # Skipping selects the old value (a product with 0 would turn an inf update into nan).
                    p.copy_(p - update if flag is None else torch.where(flag.bool(), p, p - update))


def _train(
    world: int, stage: int, bf16: bool, on_device: bool, overflow: bool, inf_step: int = INF_STEP, sgd: bool = False
) -> dict:
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed._core.optim.sharded import ShardedOptimizer

    model = make_model(0)
    if sgd:
        inner = FlagSGD(model.parameters(), lr=LR)
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 1.0 / (1 + s))
    engine, *_ = deepspeed.initialize(model=model, optimizer=inner, lr_scheduler=sched, config=_config(stage, bf16))
    opt = engine.optimizer
    if not on_device:
        opt._device_step = lambda *a, **k: None  # the host decides, as for an optimizer without the flag
    host_decisions = []
    decide = ShardedOptimizer._decide_step
    opt._decide_step = lambda sq: host_decisions.append(1) or decide(opt, sq)

    # Every host read of a tensor's value during the step, and every update, in order.
    order: list[str] = []
    reads = ("item", "tolist", "__float__", "__bool__", "__int__")
    originals = {name: getattr(torch.Tensor, name) for name in reads}
    inner_step = inner.step

    def spying_step(*a, **k):
        order.append("update")
        return inner_step(*a, **k)

    inner.step = spying_step
    norms, lrs, step_counts, applied = [], [], [], []
    for step in range(STEPS):
        handle = None
        if overflow and step == inf_step and dist.get_rank() == world - 1:
            handle = engine.module.fc1.weight.register_hook(lambda g: g * float("inf"))
        engine.backward(engine(*micro_batch(step, engine_micro_index(0, dist.get_rank(), world))))
        if handle is not None:
            handle.remove()
        order.clear()
        for name, fn in originals.items():
            setattr(
                torch.Tensor, name, lambda self, *a, _n=name, _f=fn, **k: (order.append("read"), _f(self, *a, **k))[1]
            )
        try:
            engine.step()
        finally:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)
        last_update = max((i for i, e in enumerate(order) if e == "update"), default=-1)
        applied.append(engine.was_step_applied())
        norms.append(engine.get_global_grad_norm())
        lrs.append(engine.get_lr()[0])
        master_state = next(iter(inner.state.values()), {})
        step_counts.append(float(master_state["step"]) if "step" in master_state else 0.0)
        if step == 0:
            first_state_count = len(inner.state)
        if step == 0:
            first_order = (order.index("read") if "read" in order else len(order), last_update)
    obj = [engine._zero3_consolidated_16bit_state_dict() if stage == 3 else engine.module.state_dict()]
    dist.broadcast_object_list(obj, src=0)
    out = {
        "weights": {k: v.float().clone() for k, v in obj[0].items()},
        "norms": norms,
        "lrs": lrs,
        "steps": step_counts,
        "applied": applied,
        "skipped": engine.skipped_steps,
        "host_decisions": len(host_decisions),
        "first_read_vs_last_update": first_order,
        "states_after_first_step": first_state_count,
    }
    engine.destroy()
    return out


def _both(world: int, stage: int, bf16: bool, overflow: bool) -> dict:
    return {on: _train(world, stage, bf16, on, overflow) for on in (True, False)}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_device_step_matches_host_step_and_skips_on_device(world: int, stage: int) -> None:
    for rank in run_distributed(_both, world, world, stage, True, True):
        dev, host = rank[True], rank[False]
        assert dev["host_decisions"] == 0 and host["host_decisions"] == STEPS
        # Device: the only reads follow the last update; host: the decision is read before the first one.
        first_read, last_update = dev["first_read_vs_last_update"]
        assert last_update >= 0 and first_read > last_update, dev["first_read_vs_last_update"]
        assert host["first_read_vs_last_update"][0] < host["first_read_vs_last_update"][1]
        for got in (dev, host):
            assert got["applied"] == [True, False, True] and got["skipped"] == 1
            assert got["norms"][INF_STEP] is None and all(
                math.isfinite(n) for i, n in enumerate(got["norms"]) if i != INF_STEP
            )
            assert got["steps"] == [1.0, 1.0, 2.0], "a skipped step must not advance the optimizer's step count"
            assert got["lrs"][INF_STEP] == got["lrs"][0], "the scheduler must not step on a skipped step"
        assert dev["norms"] == host["norms"] and dev["lrs"] == host["lrs"]
        for k, v in host["weights"].items():
            assert torch.equal(dev["weights"][k], v), k


def _fp32_run(world: int, stage: int) -> dict:
    return _train(world, stage, False, True, False)


@pytest.mark.parametrize("stage", [1, 3])
def test_fp32_device_step_matches_the_reference(stage: int) -> None:
    """No overflow check (fp32): no host read at all inside the step; the norm is read when asked for."""
    results = run_distributed(_fp32_run, 2, 2, stage)
    model = make_model(0)
    reference_train(
        model,
        STEPS,
        2,
        1,
        lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.01, fused=True),
        clip=0.05,
        lr_lambda=lambda s: 1.0 / (1 + s),
    )
    for rank in results:
        first_read, last_update = rank["first_read_vs_last_update"]
        assert last_update >= 0 and first_read > last_update
        assert rank["host_decisions"] == 0 and rank["applied"] == [True] * STEPS
        for k, v in model.state_dict().items():
            torch.testing.assert_close(rank["weights"][k], v.float(), rtol=1e-5, atol=1e-6)


def _sgd_both(world: int, stage: int, inf_step: int) -> dict:
    return {on: _train(world, stage, True, on, True, inf_step, sgd=True) for on in (True, False)}


@pytest.mark.parametrize("inf_step", [0, 1])
@pytest.mark.parametrize("stage", [1, 3])
def test_device_skip_puts_host_step_counts_back(stage: int, inf_step: int) -> None:
    """An optimizer counting steps on the host: a device-skipped step leaves the counts (and, on the very first
    step, the absence of state) exactly as the host-decided skip does."""
    for rank in run_distributed(_sgd_both, 2, 2, stage, inf_step):
        dev, host = rank[True], rank[False]
        assert dev["host_decisions"] == 0 and host["host_decisions"] == STEPS
        expected = [0.0, 1.0, 2.0] if inf_step == 0 else [1.0, 1.0, 2.0]
        assert dev["steps"] == host["steps"] == expected, (dev["steps"], host["steps"], dev["applied"], host["applied"])
        assert dev["states_after_first_step"] == host["states_after_first_step"]
        assert dev["applied"] == host["applied"] and dev["skipped"] == host["skipped"] == 1
        for k, v in host["weights"].items():
            assert torch.equal(dev["weights"][k], v), k
