"""ZeRO-3 optimizer state on NVMe swap files: bit-equal to host offload at world 1 and 2 (several swapped chunks,
pipelined reads and writes), upstream's file layout, checkpoints, ZeRO-1/2 fallback, bad paths and faults."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from deepspeed.ops.op_builder.async_io import AsyncIOBuilder
from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch
from tests.reference.zero_oracle import engine_micro_index

pytestmark = pytest.mark.skipif(not AsyncIOBuilder().is_compatible(), reason="the async_io op cannot be built here")

STEPS, LR = 3, 1e-2


def _config(nvme_path: str | None, stage: int = 3, **offload: object) -> dict:
    device = {"device": "nvme", "nvme_path": nvme_path} if nvme_path else {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        # A torch optimizer with per-element state, so the test needs no CPU Adam build.
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9, "weight_decay": 0.01}},
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 500,
            "sub_group_size": 256,  # several swapped chunks per group, even for this small model
            "offload_optimizer": {**device, **offload},
        },
    }


def _weights(engine) -> dict:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def _train(world: int, cfg: dict, steps: int = STEPS) -> dict:
    import deepspeed
    from deepspeed import comm as dist

    engine, *_ = deepspeed.initialize(model=make_model(0), config=cfg)
    for step in range(steps):
        engine.backward(engine(*micro_batch(step, engine_micro_index(0, dist.get_rank(), world))))
        engine.step()
    out = {"weights": _weights(engine), "class": type(engine.optimizer).__name__}
    swapper = getattr(engine.optimizer, "swapper", None)
    if swapper is not None:
        out["files"] = sorted(str(p) for f in swapper.files for p in map(f.path, f.dtypes))
        out["chunks"] = len(swapper.chunks())
        out["io"] = (swapper.bytes_read, swapper.bytes_written, swapper.backend)
    engine.destroy()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_nvme_steps_bit_equal_to_host_offload(world: int, tmp_path: Path) -> None:
    cpu = run_distributed(_train, world, world, _config(None))
    nvme = run_distributed(
        _train,
        world,
        world,
        _config(str(tmp_path), pipeline_read=True, pipeline_write=True, buffer_count=3),
    )
    for a, b in zip(cpu, nvme, strict=True):
        assert b["class"] == "NvmeStage3Optimizer" and b["chunks"] > 2, b.get("chunks")
        for k in a["weights"]:
            assert torch.equal(a["weights"][k], b["weights"][k]), k
        read, written, _ = b["io"]
        assert read > 0 and written > read / 2
    for rank, r in enumerate(nvme):
        folder = tmp_path / "zero_stage_3" / "optimizer" / f"rank{rank}"
        names = {Path(p).name for p in r["files"]}
        assert all(Path(p).parent == folder for p in r["files"])
        assert any(n.startswith("momentum_buffer-") for n in names), names
        masters = [n for n in names if n[0].isdigit()]
        assert masters and all(n.endswith(".tensor.swp") for n in masters)


def test_unpipelined_and_single_buffer_match(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    a = run_distributed(_train, 1, 1, _config(str(tmp_path / "a"), buffer_count=1))
    b = run_distributed(_train, 1, 1, _config(None))
    for k in b[0]["weights"]:
        assert torch.equal(a[0]["weights"][k], b[0]["weights"][k]), k


def _resume(world: int, cfg: dict, save_dir: str, build: Callable[[int], nn.Module] = make_model) -> dict:
    """Train, save, train on; then a fresh engine loads the save and trains the same steps again (``build``: the
    model of a seed)."""
    import deepspeed
    from deepspeed import comm as dist

    def steps(engine, first: int, count: int) -> None:
        for step in range(first, first + count):
            engine.backward(engine(*micro_batch(step, engine_micro_index(0, dist.get_rank(), world))))
            engine.step()

    engine, *_ = deepspeed.initialize(model=build(0), config=cfg)
    steps(engine, 0, 2)
    engine.save_checkpoint(save_dir, tag="t")
    steps(engine, 2, 2)
    straight = _weights(engine)
    engine.destroy()
    engine, *_ = deepspeed.initialize(model=build(1), config=cfg)
    engine.load_checkpoint(save_dir, tag="t")
    steps(engine, 2, 2)
    resumed = _weights(engine)
    engine.destroy()
    return {"straight": straight, "resumed": resumed}


@pytest.mark.parametrize("world", [1, 2])
def test_checkpoint_round_trip_with_nvme_state(world: int, tmp_path: Path) -> None:
    cfg = _config(str(tmp_path / "swap"), pipeline_read=True)
    (tmp_path / "swap").mkdir()
    for r in run_distributed(_resume, world, world, cfg, str(tmp_path / "ckpt")):
        for k in r["straight"]:
            assert torch.equal(r["straight"][k], r["resumed"][k]), k


def test_zero2_nvme_is_host_offload_with_a_warning(tmp_path: Path) -> None:
    from deepspeed._core.optim.nvme import warn_nvme_as_cpu
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils.logging import logger

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        warn_nvme_as_cpu(DeepSpeedConfig(_config(str(tmp_path), stage=2)).plan)
    finally:
        logger.removeHandler(handler)
    assert any("ZeRO stage 2" in r.getMessage() and "CPU memory" in r.getMessage() for r in records)
    a = run_distributed(_train, 1, 1, _config(str(tmp_path), stage=2))
    b = run_distributed(_train, 1, 1, _config(None, stage=2))
    assert not list(tmp_path.iterdir())  # nothing swapped
    for k in b[0]["weights"]:
        assert torch.equal(a[0]["weights"][k], b[0]["weights"][k]), k


@pytest.mark.parametrize(
    ("path", "match"),
    [
        (None, "nvme_path is required"),
        ("/does/not/exist", "does not exist"),
        ("/proc/1", "not writable"),
    ],
)
def test_bad_nvme_path_is_refused_when_the_config_is_read(path: str | None, match: str) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    cfg = _config("placeholder")
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = path
    with pytest.raises(DeepSpeedConfigError, match=f"offload_optimizer.nvme_path.*{match}|{match}"):
        DeepSpeedConfig(cfg)


def test_a_file_as_nvme_path_is_refused(tmp_path: Path) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    (tmp_path / "f").write_text("x")
    with pytest.raises(DeepSpeedConfigError, match="is not a directory"):
        DeepSpeedConfig(_config(str(tmp_path / "f")))


def _fault(world: int, cfg: dict, fault: str) -> str:
    """Train a step, damage this rank's swap files, step again: the error message (or '')."""
    import deepspeed
    from deepspeed import comm as dist

    engine, *_ = deepspeed.initialize(model=make_model(0), config=cfg)
    for step in range(2):
        if step == 1:
            files = engine.optimizer.swapper.files[0]
            victim = files.path("momentum_buffer")
            if fault == "truncate":
                os.truncate(victim, 8)
            else:
                victim.unlink()
        engine.backward(engine(*micro_batch(step, engine_micro_index(0, dist.get_rank(), world))))
        try:
            engine.step()
        except RuntimeError as err:
            return str(err)
    return ""


@pytest.mark.parametrize("fault", ["truncate", "remove"])
def test_damaged_swap_file_is_detected_not_read_as_zeros(fault: str, tmp_path: Path) -> None:
    (message,) = run_distributed(_fault, 1, 1, _config(str(tmp_path)), fault)
    assert "momentum_buffer-" in message and str(tmp_path) in message, message
    assert ("holds 8 bytes" in message) if fault == "truncate" else ("missing" in message)


def _full_disk(world: int, cfg: dict, limit: int) -> str:
    """Initialize under a file-size limit smaller than the swap files: the error message."""
    import resource
    import signal

    import deepspeed

    AsyncIOBuilder().load()  # built (or found in the cache) before the limit: a compiler writes large files
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        engine, *_ = deepspeed.initialize(model=make_model(0), config=cfg)
        engine.backward(engine(*micro_batch(0, engine_micro_index(0, 0, world))))
        engine.step()
    except OSError as err:
        return str(err)
    return ""


def test_disk_full_names_the_file_and_the_bytes(tmp_path: Path) -> None:
    (message,) = run_distributed(_full_disk, 1, 1, _config(str(tmp_path)), 4096)
    assert ".tensor.swp needs" in message and str(tmp_path) in message and "bytes" in message, message
    assert "nvme_path" in message
