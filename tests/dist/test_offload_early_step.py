"""An offloaded ZeRO-1/2 update starts during the boundary backward when no global decision is needed
([Note: early host step]): the first chunks are stepped before the last gradient bucket is reduced, and the
result is bit-identical to the synchronous step. With gradient clipping the update still waits for the backward."""

from __future__ import annotations

import threading
import time

import pytest

from tests._harness import run_distributed
from tests.dist.test_offload_overlap import assert_bit_equal, optimizer_snapshot
from tests.reference.models import make_model, micro_batch
from tests.reference.zero_oracle import engine_micro_index

STEPS = 2
CHUNK = 256  # elements per step chunk: the tiny model's partition steps in several chunks
WAIT_S = 5.0  # how long the backward is held for the first early chunk (only ever waited out when it is missing)


def _config(stage: int, gas: int, overlap: bool, clip: float) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "bf16": {"enabled": True, "check_grad_overflow": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 400,
            "offload_optimizer": {"device": "cpu"},
            "lean_overlap_offload_step": overlap,
        },
    }


class _EventLog:
    """Reducer events and host-step starts in the order they happened; the backward is held after the
    second-to-last bucket is reduced until a host step has started (or ``WAIT_S`` passed)."""

    def __init__(self, last_bucket: int, hold: bool) -> None:
        self.events: list[tuple] = []
        self.last, self.hold = last_bucket, hold
        self.stepped = threading.Event()

    def reducer(self, event: str, index: int) -> None:
        self.events.append((event, index))
        if self.hold and event == "reduced" and index == self.last - 1:
            self.stepped.wait(WAIT_S)

    def host(self, event: str, group: int, start: int) -> None:
        self.events.append((event, group, start))
        self.stepped.set()

    def first_step_before_last_reduce(self) -> bool:
        first = next(i for i, e in enumerate(self.events) if e[0] == "host_step")
        return first < self.events.index(("reduced", self.last))


def _train(world: int, stage: int, gas: int, overlap: bool, clip: float) -> dict:
    import deepspeed
    import deepspeed._core.optim.stage12 as stage12
    from deepspeed import comm as dist

    stage12.step_chunk_numel = lambda *_: CHUNK  # type: ignore[assignment]
    engine, *_ = deepspeed.initialize(model=make_model(0), config=_config(stage, gas, overlap, clip))
    opt = engine.optimizer
    early_before_last, seconds, norms = [], 0.0, []
    for step in range(STEPS):
        log = _EventLog(len(opt.reducer.buckets) - 1, hold=overlap and clip == 0)
        if opt.host_step is not None:
            opt.host_step.log = log.host
        began = time.perf_counter()
        for micro in range(gas):
            # Only the boundary backward's events: ZeRO-2 also reduces the earlier micro-steps.
            opt.observe(log.reducer if micro == gas - 1 else (lambda *_: None))
            index = engine_micro_index(micro, dist.get_rank(), world)
            engine.backward(engine(*micro_batch(step, index)))
            engine.step()
        seconds += time.perf_counter() - began
        norms.append(engine.get_global_grad_norm())  # what a trainer logs as grad_norm
        if opt.host_step is not None:
            early_before_last.append(log.first_step_before_last_reduce())
    result = {
        **optimizer_snapshot(engine),
        "early_chunks": opt.early_chunks,
        "early_before_last": early_before_last,
        "chunks": sum(-(-g.master.numel() // CHUNK) for g in opt.groups),
        "seconds": seconds,
        "norms": norms,
    }
    engine.destroy()
    return result


def _train_three(world: int, stage: int, gas: int) -> dict:
    return {
        "early": _train(world, stage, gas, True, 0.0),
        "sync": _train(world, stage, gas, False, 0.0),
        "clipped": _train(world, stage, gas, True, 0.5),
    }


@pytest.mark.parametrize(("world", "stage", "gas"), [(1, 2, 1), (2, 1, 2), (2, 2, 2)])
def test_offloaded_step_starts_during_backward_and_is_bit_identical(world: int, stage: int, gas: int) -> None:
    for rank in run_distributed(_train_three, world, world, stage, gas):
        early, sync, clipped = rank["early"], rank["sync"], rank["clipped"]
        assert early["chunks"] > 2
        # Chunks went to the host worker before the backward ended, and one of them started stepping before
        # the last gradient bucket of that same backward was reduced.
        assert early["early_chunks"] > 0
        assert all(early["early_before_last"]), early["early_before_last"]
        assert early["seconds"] < STEPS * WAIT_S  # the held backward never had to wait the timeout out
        assert_bit_equal(early, sync)
        # The reported norm counts the chunks stepped early too.
        assert early["norms"] == sync["norms"] and all(n > 0 for n in early["norms"]), (early["norms"], sync["norms"])
        # Clipping needs the global norm first: the update waits for the backward, as before.
        assert clipped["early_chunks"] == 0
        assert not any(clipped["early_before_last"]), clipped["early_before_last"]
