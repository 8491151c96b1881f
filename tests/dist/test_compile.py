"""``engine.compile()`` trains at ZeRO stages 0-3 with the losses of the eager engine and of the single-process
reference, and the model's forward really runs in compiled graphs (dynamo counters).

ZeRO-3's fetch/release hooks swap ``param.data``; traced by dynamo that is an in-place ``set_`` that bumps the
version counter of a parameter another compiled graph saved for backward, so they run eagerly (a graph break at
each hook; see [Note: zero3 under compile] in docs/design/zero3.md). Inductor needs a C++ compiler on CPU; the
ZeRO-3 case uses inductor, stages 0-2 use aot_eager (the same AOT-autograd path, without code generation, to
keep this file fast). The model has no activation checkpointing: under ZeRO-3 a checkpointed region runs
uncompiled (the known limit in that note).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch
from tests.reference.zero_oracle import engine_micro_index, reference_train

STEPS = 3
LR = 1e-2


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        # threshold 0: every parameter is partitioned, so every module's hooks gather and release.
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _train(stage: int, backend: str | None) -> tuple[list[float], dict[str, int]]:
    import deepspeed
    from deepspeed import comm as dist
    from torch._dynamo.utils import counters

    engine, *_ = deepspeed.initialize(model=make_model(0), config=_config(stage))
    torch._dynamo.reset()
    counters.clear()
    if backend is not None:
        engine.compile(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(STEPS):
        loss = engine(*micro_batch(step, engine_micro_index(0, rank, world)))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    stats = dict(counters["stats"])
    engine.destroy()
    return losses, stats


def _reference_calls(backend: str) -> int:
    """Ops dynamo captures when compiling the plain model (its whole forward)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = torch.compile(make_model(0), backend=backend)
    model(*micro_batch(0, 0))
    return int(counters["stats"]["calls_captured"])


def _compare(stages: list[int], backend: str) -> dict[int, tuple[list[float], list[float], dict[str, int]]]:
    out = {}
    for stage in stages:
        eager, _ = _train(stage, None)
        compiled, stats = _train(stage, backend)
        out[stage] = (eager, compiled, stats)
    return out


def _reference_losses(world: int) -> list[float]:
    return reference_train(make_model(0), STEPS, world, 1, lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=0.0))


def _check(results: dict, backend: str, world: int, tolerance: float) -> None:
    expected_calls = _reference_calls(backend)
    reference = _reference_losses(world)
    for stage, (eager, compiled, stats) in results.items():
        assert compiled == pytest.approx(eager, rel=tolerance, abs=tolerance), (stage, eager, compiled)
        assert compiled == pytest.approx(reference, rel=1e-5, abs=1e-6), (stage, reference, compiled)
        # Every op of the model's forward ran inside a compiled graph (ZeRO-3: several, split at its hooks).
        assert stats.get("unique_graphs", 0) >= 1, (stage, stats)
        assert stats.get("calls_captured", 0) >= expected_calls, (stage, stats, expected_calls)


@pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="inductor on CPU needs a C++ compiler"
)
def test_zero3_compiled_matches_eager_inductor() -> None:
    results = run_distributed(_compare, 2, [3], "inductor", timeout=300)
    for rank_results in results:
        # Inductor fuses kernels, so its float rounding differs slightly from eager's.
        _check(rank_results, "inductor", 2, 1e-5)


def test_zero_0_1_2_compiled_match_eager() -> None:
    for rank_results in run_distributed(_compare, 2, [0, 1, 2], "aot_eager", timeout=300):
        _check(rank_results, "aot_eager", 2, 0.0)


def _refused_compile_arguments() -> list[str]:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=make_model(0), config=_config(2))
    messages = []
    for kwargs in ({"schedule": [(0, [])]}, {"compiled_autograd_enabled": True}):
        try:
            engine.compile(**kwargs)
            messages.append("no error")
        except NotImplementedError as err:
            messages.append(str(err))
    return messages


def test_unimplemented_compile_arguments_raise() -> None:
    for message in run_distributed(_refused_compile_arguments, 1, timeout=60)[0]:
        assert "schedule" in message and "compiled_autograd_enabled" in message, message
