"""ZeRO-3 parameter partitions on NVMe swap files: bit-equal to ``offload_param.device: "cpu"`` at world 1 and 2
(with and without NVMe optimizer state), upstream's file layout, reads ahead of the gather, a bounded host
footprint, checkpoints, ZeRO-1/2 ignoring the block, bad paths and damaged files.

The model is the small reference MLP with two wide layers: only their weights have partitions of at least 1 MiB
and are swapped; the other partitions are under the threshold and stay in host memory ([Note: nvme params])."""

from __future__ import annotations

import logging
import os
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

from deepspeed._core.params.swap import MIN_AIO_BYTES
from deepspeed._core.params.swap import _settle as settle
from deepspeed.ops.op_builder.async_io import AsyncIOBuilder
from tests._harness import run_distributed
from tests.dist.test_nvme_offload import _resume, _weights
from tests.reference.models import TinyMLP, micro_batch
from tests.reference.zero_oracle import engine_micro_index

pytestmark = pytest.mark.skipif(not AsyncIOBuilder().is_compatible(), reason="the async_io op cannot be built here")

STEPS, LR = 3, 1e-2
HIDDEN = 23  # TinyMLP's default width
WIDE = ("wide_a.weight", "wide_b.weight")  # the swapped parameters


def _copies(world: int) -> int:
    """Output copies of the hidden state in a wide layer: its bf16 weight partition reaches 1 MiB at ``world``."""
    return -(-MIN_AIO_BYTES * world // (2 * HIDDEN * HIDDEN))


def _partition(world: int) -> int:
    """Elements of a rank's partition of a wide weight."""
    return -(-HIDDEN * HIDDEN * _copies(world) // world)


BUFFER = max(_partition(1), _partition(2))  # elements per swap buffer: a wide weight's partition fits


class WideMLP(TinyMLP):
    """The reference MLP with two wide layers in front: each maps the hidden state to ``_copies(world)`` copies and
    averages them back, so its weight's partition is at least 1 MiB and is swapped, its bias is not."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.copies = _copies(world)
        self.wide_a = nn.Linear(HIDDEN, HIDDEN * self.copies)
        self.wide_b = nn.Linear(HIDDEN, HIDDEN * self.copies)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for wide in (self.wide_a, self.wide_b):
            h = h + wide(h).unflatten(-1, (self.copies, HIDDEN)).mean(-2)
        h = h + self.fc2(torch.relu(self.fc1(h)))
        logits = self.head(self.norm(h)).float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def wide_model(seed: int, world: int) -> WideMLP:
    """A freshly initialised :class:`WideMLP` whose weights depend only on ``seed``."""
    torch.manual_seed(seed)
    return WideMLP(world)


def _config(param_path: str | None, opt_path: str | None = None, stage: int = 3, **param: object) -> dict:
    offload_param = {"device": "nvme", "nvme_path": param_path} if param_path else {"device": "cpu"}
    if param_path:
        offload_param |= {"buffer_count": 3, "buffer_size": BUFFER, "max_in_cpu": 0}
    offload_opt = {"device": "nvme", "nvme_path": opt_path} if opt_path else {"device": "cpu"}
    # With parameters on NVMe gradients wait in the host accumulator (lean_grads_in_param_shards has no effect);
    # the reference takes the same path: the in-shard one sums the clipping norm in another order.
    grads = {} if param_path else {"lean_grads_in_param_shards": False}
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9, "weight_decay": 0.01}},
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 500,
            "sub_group_size": 100_000,  # step chunks that split the wide weights' partitions
            "stage3_param_persistence_threshold": 0,  # every parameter is fetched (and swapped) per use
            "offload_param": {**offload_param, **param},
            "offload_optimizer": offload_opt,
            **grads,
        },
    }


def _swapper(engine):
    manager = getattr(engine.optimizer, "manager", None)
    return None if manager is None else manager.gatherer.swapper


def _swapped_names(engine) -> set[str]:
    from deepspeed._core.params.param import zero_state

    entries = _swapper(engine).entries
    return {name for name, p in engine.module.named_parameters() if zero_state(p).ds_id in entries}


def _train(world: int, cfg: dict, steps: int = STEPS) -> dict:
    import deepspeed
    from deepspeed import comm as dist

    engine, *_ = deepspeed.initialize(model=wide_model(0, world), config=cfg)
    losses = []
    for step in range(steps):
        loss = engine(*micro_batch(step, engine_micro_index(0, dist.get_rank(), world)))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    out = {"weights": _weights(engine), "losses": losses}
    swapper = _swapper(engine)
    if swapper is not None:
        out["files"] = sorted(str(e.path) for e in swapper.entries.values())
        out["swapped"] = _swapped_names(engine)
        folder = Path(cfg["zero_optimization"]["offload_param"]["nvme_path"]) / "zero_stage_3"
        out["on_disk"] = sorted(str(f) for f in folder.glob(f"*/rank{dist.get_rank()}/*"))
        out["stats"] = swapper.stats
        out["host"] = (swapper.pool_bytes(), swapper.resident_bytes)
        out["partition_bytes"] = sum(s.layout.partition_numel * 2 for s in engine.optimizer.manager.states.values())
        out["shard_bytes"] = sum(s.shard.untyped_storage().nbytes() for s in engine.optimizer.manager.states.values())
    engine.destroy()
    return out


@pytest.mark.parametrize(("world", "opt_nvme", "persist"), [(1, False, 0), (2, False, 100), (2, True, 0)])
def test_nvme_params_bit_equal_to_cpu_offload(world: int, opt_nvme: bool, persist: int, tmp_path: Path) -> None:
    """``persist``: parameters of at most this many elements stay gathered between uses (re-gathered from their
    swap files after each step)."""
    opt_path = None
    if opt_nvme:
        opt_path = str(tmp_path / "opt")
        (tmp_path / "opt").mkdir()
    cpu_cfg, nvme_cfg = _config(None, opt_path), _config(str(tmp_path), opt_path)
    for cfg in (cpu_cfg, nvme_cfg):
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = persist
    cpu = run_distributed(_train, world, world, cpu_cfg)
    nvme = run_distributed(_train, world, world, nvme_cfg)
    for a, b in zip(cpu, nvme, strict=True):
        assert a["losses"] == b["losses"]
        for k in a["weights"]:
            assert torch.equal(a["weights"][k], b["weights"][k]), k
        stats = b["stats"]
        assert stats.reads > 0 and stats.writes > 0, stats
        assert stats.overlapped_writes > 0, stats  # write-backs of consecutive partitions in flight together
        # Reads were started ahead of the gathers (trace order) and the gathers found them in a buffer.
        assert stats.read_ahead > 0 and stats.read_ahead_used > 0, stats
    for rank, r in enumerate(nvme):
        assert r["swapped"] == set(WIDE), r["swapped"]  # every partition under 1 MiB stays in host memory
        folder = tmp_path / "zero_stage_3" / "bfloat16params" / f"rank{rank}"
        assert r["on_disk"] == r["files"]  # no file for a partition kept in host memory
        assert len(r["files"]) == len(WIDE) and all(Path(p).parent == folder for p in r["files"]), r["files"]
        assert all(Path(p).name.endswith("_param.tensor.swp") and Path(p).name[0].isdigit() for p in r["files"])


def _footprint(world: int, cfg: dict) -> dict:
    """Train while sampling, inside a forward, the host bytes that hold parameter partitions: every distinct
    storage behind a shard, plus the swap buffers."""
    import deepspeed

    engine, *_ = deepspeed.initialize(model=wide_model(0, world), config=cfg)
    manager, swapper = engine.optimizer.manager, _swapper(engine)
    samples: list[int] = []

    def sample(*_: object) -> None:
        storages = {
            s.shard.untyped_storage().data_ptr(): s.shard.untyped_storage().nbytes() for s in manager.states.values()
        }
        for slot in swapper.slots:
            if slot.buffer is not None:
                storages[slot.buffer.untyped_storage().data_ptr()] = slot.buffer.untyped_storage().nbytes()
        samples.append(sum(storages.values()))

    handle = engine.module.fc2.register_forward_hook(sample)
    for step in range(STEPS):
        engine.backward(engine(*micro_batch(step, engine_micro_index(0, 0, world))))
        engine.step()
    handle.remove()
    out = {
        "weights": _weights(engine),
        "samples": samples,
        "pool": swapper.pool_bytes(),
        "resident": swapper.resident_bytes,
        "all": sum(s.layout.partition_numel * 2 for s in manager.states.values()),
        "states": len(manager.states),
    }
    engine.destroy()
    return out


def test_host_memory_is_the_pool_plus_the_kept_partitions(tmp_path: Path) -> None:
    # The small partitions stay on the host; one buffer serves both wide weights.
    count = 1
    cfg = _config(str(tmp_path), buffer_count=count)
    (r,) = run_distributed(_footprint, 1, 1, cfg)
    (ref,) = run_distributed(_train, 1, 1, _config(None))
    for k in ref["weights"]:
        assert torch.equal(ref["weights"][k], r["weights"][k]), k
    assert r["resident"] == r["all"] - len(WIDE) * _partition(1) * 2, r  # every partition but the wide weights
    bound = count * BUFFER * 2 + r["resident"] + r["states"] * 2  # + the one-element placeholders
    assert r["pool"] <= count * BUFFER * 2
    assert r["samples"] and max(r["samples"]) <= bound, (r["samples"], bound)
    assert max(r["samples"]) < r["all"], (r["samples"], r["all"])  # not every partition in memory


@pytest.mark.parametrize(("world", "opt_nvme"), [(1, False), (2, True)])
def test_checkpoint_round_trip_with_nvme_params(world: int, opt_nvme: bool, tmp_path: Path) -> None:
    (tmp_path / "opt").mkdir()
    cfg = _config(str(tmp_path / "swap"), str(tmp_path / "opt") if opt_nvme else None)
    (tmp_path / "swap").mkdir()
    build = partial(wide_model, world=world)
    for r in run_distributed(_resume, world, world, cfg, str(tmp_path / "ckpt"), build):
        for k in r["straight"]:
            assert torch.equal(r["straight"][k], r["resumed"][k]), k


def _build(world: int, cfg: dict) -> str:
    import deepspeed

    try:
        deepspeed.initialize(model=wide_model(0, world), config=cfg)
    except ValueError as err:
        return str(err)
    return ""


def test_partition_larger_than_buffer_size_is_refused_before_partitioning(tmp_path: Path) -> None:
    # World 2: each rank raises on its own, before any collective (a rank waiting in one would hang the test).
    for message in run_distributed(_build, 2, 2, _config(str(tmp_path), buffer_size=500)):
        assert "offload_param.buffer_size=500" in message and "than 2 parameter partition(s)" in message, message
        assert f"{_partition(2)} elements" in message and f"at least {_partition(2)}" in message, message
        assert "max_in_cpu" in message, message
    assert not (tmp_path / "zero_stage_3").exists()  # nothing written


@pytest.mark.parametrize(
    ("path", "match"),
    [(None, "nvme_path is required"), ("/does/not/exist", "does not exist"), ("/proc/1", "not writable")],
)
def test_bad_param_nvme_path_is_refused_at_stage_3_only(path: str | None, match: str) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    cfg = _config("placeholder")
    cfg["zero_optimization"]["offload_param"]["nvme_path"] = path
    with pytest.raises(DeepSpeedConfigError, match=f"offload_param.nvme_path.*{match}|{match}"):
        DeepSpeedConfig(cfg)
    cfg["zero_optimization"]["stage"] = 2  # stages 0-2 ignore offload_param, as upstream does
    DeepSpeedConfig(cfg)


def test_zero2_ignores_nvme_params_with_a_warning(tmp_path: Path) -> None:
    from deepspeed._core.engine.setup import warn_param_offload_ignored
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils.logging import logger

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        warn_param_offload_ignored(DeepSpeedConfig(_config(str(tmp_path), stage=2)).plan)
        warn_param_offload_ignored(DeepSpeedConfig(_config(str(tmp_path), stage=3)).plan)
    finally:
        logger.removeHandler(handler)
    said = [r.getMessage() for r in records if "offload_param" in r.getMessage()]
    assert len(said) == 1 and "ZeRO stage 2" in said[0] and "'nvme'" in said[0], said
    a = run_distributed(_train, 1, 1, _config(str(tmp_path), stage=2))
    b = run_distributed(_train, 1, 1, _config(None, stage=2))
    assert not list(tmp_path.iterdir())  # nothing swapped
    for k in b[0]["weights"]:
        assert torch.equal(a[0]["weights"][k], b[0]["weights"][k]), k


def _fault(world: int, cfg: dict, fault: str) -> str:
    """Train a step, damage one swap file, step again: the error message (or '')."""
    import deepspeed

    engine, *_ = deepspeed.initialize(model=wide_model(0, world), config=cfg)
    for step in range(2):
        if step == 1:
            # Damage a partition that is in no buffer (one read ahead before the damage rightly holds good values),
            # once its last write has landed (a write still in flight would extend the truncated file again).
            idle = [e for e in _swapper(engine).entries.values() if e.slot is None]
            assert idle, "every partition is in a buffer: nothing left to read from disk"
            entry = max(idle, key=lambda e: e.numel)
            if entry.write_slot is not None:
                settle(entry.write_slot)
            victim = entry.path
            if fault == "truncate":
                os.truncate(victim, 8)
            else:
                victim.unlink()
        try:
            engine.backward(engine(*micro_batch(step, engine_micro_index(0, 0, world))))
            engine.step()
        except RuntimeError as err:
            return str(err)
    return ""


@pytest.mark.parametrize("fault", ["truncate", "remove"])
def test_damaged_param_swap_file_is_detected_not_read_as_zeros(fault: str, tmp_path: Path) -> None:
    (message,) = run_distributed(_fault, 1, 1, _config(str(tmp_path)), fault)
    assert "_param.tensor.swp" in message and str(tmp_path) in message and "parameter partition" in message, message
    assert ("holds 8 bytes" in message) if fault == "truncate" else ("missing" in message), message


def _train_zero_init(world: int, cfg: dict) -> dict:
    import deepspeed

    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = wide_model(0, world)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    for step in range(2):
        engine.backward(engine(*micro_batch(step, engine_micro_index(0, 0, world))))
        engine.step()
    swapper = _swapper(engine)
    out = {"weights": _weights(engine), "swapped": 0 if swapper is None else len(swapper.entries)}
    engine.destroy()
    return out


def test_zero_init_partitions_move_to_swap_files(tmp_path: Path) -> None:
    (a,) = run_distributed(_train_zero_init, 1, 1, _config(str(tmp_path)))
    (b,) = run_distributed(_train_zero_init, 1, 1, _config(None))
    assert a["swapped"] == len(WIDE) and b["swapped"] == 0
    for k in b["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), k


def _two_engines(world: int, cfg: dict, stale: str) -> dict:
    import deepspeed

    first, *_ = deepspeed.initialize(model=wide_model(0, world), config=cfg)
    emptied = not Path(stale).exists()
    second, *_ = deepspeed.initialize(model=wide_model(1, world), config=cfg)
    for engine in (first, second, first):
        engine.backward(engine(*micro_batch(0, engine_micro_index(0, 0, world))))
        engine.step()
    names = {e.path.name for e in _swapper(first).entries.values()} & {
        e.path.name for e in _swapper(second).entries.values()
    }
    first.destroy()
    second.destroy()
    return {"emptied": emptied, "shared_names": names}


def test_folder_is_emptied_once_per_process_and_shared_by_a_second_engine(tmp_path: Path) -> None:
    folder = tmp_path / "zero_stage_3" / "bfloat16params" / "rank0"
    folder.mkdir(parents=True)
    stale = folder / "999_param.tensor.swp"
    stale.write_bytes(b"left by an earlier run")
    (r,) = run_distributed(_two_engines, 1, 1, _config(str(tmp_path)), str(stale))
    assert r["emptied"] and not r["shared_names"], r
