"""An offloaded ZeRO-3 update starts during the boundary backward when no global decision is needed
([Note: early host step], [Note: final gradient count]): from the second boundary on, the chunks whose parameters'
gradients have all arrived as often as recorded go to the host worker before the backward ends, and the result is
bit-identical to the synchronous step; with gradient clipping, or NVMe optimizer state, nothing starts early. A
backward that differs from the record falls back to ``step()`` where that is exact and raises where it is not."""

from __future__ import annotations

import threading

import pytest
import torch

from deepspeed.ops.op_builder.async_io import AsyncIOBuilder
from tests._harness import run_distributed
from tests.dist.test_offload_overlap import assert_bit_equal, optimizer_snapshot
from tests.reference.models import TinyMLP, micro_batch
from tests.reference.zero_oracle import engine_micro_index

STEPS = 3
CHUNK = 256  # elements per step chunk: the tiny model's master steps in about 16 chunks
WAIT_S = 5.0  # how long the embedding's backward waits for the first early chunk (waited out only when none comes)


class VaryingMLP(TinyMLP):
    """:class:`TinyMLP` whose forward can differ between steps: ``skip`` leaves the hidden layers out (they get no
    gradient), ``extra_head`` adds a second use of the head (tied: one more gradient arrival of the table)."""

    skip = False
    extra_head = False

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if not self.skip:
            h = h + self.fc2(torch.relu(self.fc1(h)))
        logits = self.head(self.norm(h)).float()
        if self.extra_head:
            logits = logits + self.head(h).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _config(gas: int, clip: float, bf16: bool, early: bool = True, nvme: str | None = None) -> dict:
    offload = {"device": "nvme", "nvme_path": nvme} if nvme else {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        **({"bf16": {"enabled": True, "check_grad_overflow": False}} if bf16 else {}),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 400,
            "stage3_param_persistence_threshold": 30,
            "offload_optimizer": offload,
            "lean_overlap_offload_step": early,
        },
    }


class _Hold:
    """Logs host-step starts and the embedding's backward; once armed, that backward (the last one) waits for the
    first host step (or ``WAIT_S``), so a chunk submitted before it is seen starting before the backward ends."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.stepped = threading.Event()
        self.armed = False

    def host(self, event: str, group: int, start: int) -> None:
        self.events.append(event)
        self.stepped.set()

    def embed(self, module: torch.nn.Module, grad_output: object) -> None:
        if self.armed:
            self.stepped.wait(WAIT_S)
            self.events.append("embed_backward")

    def stepped_before_embed(self) -> bool:
        return "host_step" in self.events and self.events.index("host_step") < self.events.index("embed_backward")


def _engine(cfg: dict, tied: bool = True):
    import deepspeed
    import deepspeed._core.optim.stage3 as stage3

    stage3.step_chunk_numel = lambda *_: CHUNK  # type: ignore[assignment]
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=VaryingMLP(tied=tied), config=cfg)
    return engine


def _train(
    world: int, cfg: dict, tied: bool = True, skips: tuple[bool, ...] = (False,) * STEPS, hold_last: bool = True
) -> dict:
    from deepspeed import comm as dist

    engine = _engine(cfg, tied)
    opt, hold = engine.optimizer, _Hold()
    if opt.host_step is not None:
        opt.host_step.log = hold.host
    engine.module.embed.register_full_backward_pre_hook(hold.embed)
    gas, before_embed, norms = cfg["gradient_accumulation_steps"], [], []
    for step, skip in enumerate(skips):
        engine.module.skip = skip
        for micro in range(gas):
            hold.events.clear()
            hold.stepped.clear()
            # Only a boundary backward after the recorded one may step early.
            hold.armed = hold_last and not skip and step > 0 and micro == gas - 1 and opt.steps_during_backward()
            engine.backward(engine(*micro_batch(step, engine_micro_index(micro, dist.get_rank(), world))))
            if hold.armed:
                before_embed.append(hold.stepped_before_embed())
            engine.step()
        norms.append(engine.get_global_grad_norm())  # what a trainer logs as grad_norm
    result = {**optimizer_snapshot(engine), "early_chunks": opt.early_chunks, "before_embed": before_embed}
    result["norms"] = norms
    result["chunks"] = sum(-(-g.master.numel() // CHUNK) for g in opt.groups)
    engine.destroy()
    return result


def _early_and_sync(world: int, gas: int, bf16: bool, tied: bool) -> dict:
    return {
        "early": _train(world, _config(gas, 0.0, bf16), tied),
        "sync": _train(world, _config(gas, 0.0, bf16, early=False), tied),
        "clipped": _train(world, _config(gas, 0.5, bf16), tied),
    }


@pytest.mark.parametrize(
    ("world", "gas", "bf16", "tied"), [(1, 1, True, True), (2, 2, False, True), (2, 1, True, False), (4, 1, True, True)]
)
def test_zero3_offloaded_step_starts_during_backward_and_is_bit_identical(
    world: int, gas: int, bf16: bool, tied: bool
) -> None:
    for rank in run_distributed(_early_and_sync, world, world, gas, bf16, tied):
        early, sync, clipped = rank["early"], rank["sync"], rank["clipped"]
        assert early["chunks"] >= 4
        # Chunks went to the host worker during every boundary backward after the recorded one, and one started
        # stepping before the backward reached the embedding (the last layer of the backward).
        assert early["early_chunks"] > 0
        assert early["before_embed"] == [True] * (STEPS - 1), early["before_embed"]
        assert_bit_equal(early, sync)
        # The reported norm counts the chunks stepped early too.
        assert early["norms"] == sync["norms"] and all(n > 0 for n in early["norms"]), (early["norms"], sync["norms"])
        # Clipping needs the global norm first: the update waits for the backward.
        assert clipped["early_chunks"] == 0 and clipped["before_embed"] == []


def _varying(world: int) -> dict:
    # Step 0 (the record) leaves fc1/fc2 out; steps 1-2 use them (arrivals beyond a record of none), step 3 leaves
    # them out again (fewer arrivals than step 1-2): every difference falls back to step(), exactly.
    skips = (True, False, False, True, False)
    return {
        "early": _train(world, _config(1, 0.0, True), skips=skips, hold_last=False),
        "sync": _train(world, _config(1, 0.0, True, early=False), skips=skips, hold_last=False),
    }


@pytest.mark.world_size(2)
def test_backward_that_differs_from_the_record_falls_back_exactly() -> None:
    out = _varying(2)
    assert out["early"]["early_chunks"] > 0  # the table's chunks (two arrivals every step) still went early
    assert_bit_equal(out["early"], out["sync"])


def _late_arrival(world: int) -> str:
    from deepspeed import comm as dist

    engine = _engine(_config(1, 0.0, True))
    for step in range(3):
        engine.module.extra_head = step == 2  # a third arrival of the tied table after its chunks were submitted
        try:
            engine.backward(engine(*micro_batch(step, engine_micro_index(0, dist.get_rank(), world))))
        except RuntimeError as err:
            opt = engine.optimizer
            # The early update was waited for and dropped, and nothing starts early any more.
            assert opt._early.run is None and not opt._early.armed and not opt.steps_during_backward()
            submitted = opt.early_chunks
            engine.destroy()  # no hang
            return f"{submitted} {err}"
        engine.step()
    engine.destroy()
    return "no error"


@pytest.mark.world_size(2)
def test_arrival_after_its_chunk_was_submitted_is_refused_on_every_rank() -> None:
    message = _late_arrival(2)
    submitted, _, text = message.partition(" ")
    assert int(submitted) > 0, message
    assert "received another gradient after the update of its step chunks" in text, message
    assert "lean_overlap_offload_step" in text, message


@pytest.mark.world_size(1)
def test_early_update_without_a_step_is_abandoned_cleanly() -> None:
    from deepspeed import comm as dist

    engine = _engine(_config(1, 0.0, True))
    opt = engine.optimizer
    for step in range(2):
        engine.backward(engine(*micro_batch(step, engine_micro_index(0, dist.get_rank(), 1))))
        if step == 0:
            engine.step()
    assert opt.early_chunks > 0 and opt._early.run is not None
    opt.zero_grad()  # no step took the update over: it is waited for and the optimizer gets its state back
    assert opt._early.run is None
    assert all(g.master.param in opt.optimizer.state for g in opt.groups)
    engine.step()  # the boundary, on zero gradients
    engine.backward(engine(*micro_batch(2, 0)))  # and training goes on
    engine.step()
    assert all(torch.isfinite(g.master.data).all() for g in opt.groups)
    engine.destroy()


@pytest.mark.skipif(not AsyncIOBuilder().is_compatible(), reason="the async_io op cannot be built here")
@pytest.mark.world_size(1)
def test_nvme_optimizer_state_is_not_stepped_early(tmp_path) -> None:
    engine = _engine(_config(1, 0.0, True, nvme=str(tmp_path)))
    opt = engine.optimizer
    assert type(opt).__name__ == "NvmeStage3Optimizer" and not opt.steps_during_backward()
    for step in range(2):
        engine.backward(engine(*micro_batch(step, 0)))
        engine.step()
    assert opt.early_chunks == 0
    engine.destroy()


def _with_grad_read(early: bool) -> tuple[dict, list[torch.Tensor], str]:
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

    engine = _engine(_config(1, 0.0, True, early=early))
    grads = []
    for step in range(3):
        engine.backward(engine(*micro_batch(step, 0)))
        # fc2's weight waits in its shard; once its chunks were submitted the read waits for their update.
        grads.append(safe_get_full_grad(engine.module.fc2.weight).clone())
        engine.step()
    snapshot = optimizer_snapshot(engine)
    engine.backward(engine(*micro_batch(3, 0)))
    try:
        safe_set_full_grad(engine.module.fc2.weight, grads[-1])
        refused = ""
    except RuntimeError as err:
        refused = str(err)
    engine.destroy()
    return snapshot, grads, refused


@pytest.mark.world_size(1)
def test_gradient_read_before_step_waits_and_a_gradient_write_is_refused() -> None:
    early, early_grads, refused = _with_grad_read(True)
    sync, sync_grads, not_refused = _with_grad_read(False)
    assert all(torch.equal(a, b) for a, b in zip(early_grads, sync_grads, strict=True))
    assert_bit_equal(early, sync)
    # Setting a gradient whose chunk's update already started cannot be honoured: refused, naming the parameter.
    assert "had its gradient set after the update of its step chunks" in refused, refused
    assert not_refused == ""
