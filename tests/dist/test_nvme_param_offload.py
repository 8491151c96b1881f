"""ZeRO-3 parameter partitions on NVMe swap files: bit-equal to ``offload_param.device: "cpu"`` at world 1 and 2
(with and without NVMe optimizer state), upstream's file layout, reads ahead of the gather, a bounded host
footprint, checkpoints, ZeRO-1/2 ignoring the block, bad paths and damaged files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from deepspeed.ops.op_builder.async_io import AsyncIOBuilder
from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch
from tests.reference.zero_oracle import engine_micro_index

pytestmark = pytest.mark.skipif(not AsyncIOBuilder().is_compatible(), reason="the async_io op cannot be built here")

STEPS, LR = 3, 1e-2
BUFFER = 1100  # elements per swap buffer: every partition of the test model fits


def _config(param_path: str | None, opt_path: str | None = None, stage: int = 3, **param: object) -> dict:
    offload_param = {"device": "nvme", "nvme_path": param_path} if param_path else {"device": "cpu"}
    if param_path:
        offload_param |= {"buffer_count": 3, "buffer_size": BUFFER, "max_in_cpu": 0}
    offload_opt = {"device": "nvme", "nvme_path": opt_path} if opt_path else {"device": "cpu"}
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
            "sub_group_size": 256,
            "stage3_param_persistence_threshold": 0,  # every parameter is fetched (and swapped) per use
            "offload_param": {**offload_param, **param},
            "offload_optimizer": offload_opt,
        },
    }


def _weights(engine) -> dict:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def _swapper(engine):
    return engine.optimizer.manager.gatherer.swapper


def _train(world: int, cfg: dict, steps: int = STEPS) -> dict:
    import deepspeed
    from deepspeed import comm as dist

    engine, *_ = deepspeed.initialize(model=make_model(0), config=cfg)
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
        out["stats"] = swapper.stats
        out["host"] = (swapper.pool_bytes(), swapper.resident_bytes)
        out["partition_bytes"] = sum(s.layout.partition_numel * 2 for s in engine.optimizer.manager.states.values())
        out["shard_bytes"] = sum(
            s.shard.untyped_storage().nbytes() for s in engine.optimizer.manager.states.values()
        )
    engine.destroy()
    return out


@pytest.mark.parametrize(("world", "opt_nvme"), [(1, False), (2, False), (2, True)])
def test_nvme_params_bit_equal_to_cpu_offload(world: int, opt_nvme: bool, tmp_path: Path) -> None:
    opt_path = None
    if opt_nvme:
        opt_path = str(tmp_path / "opt")
        (tmp_path / "opt").mkdir()
    cpu = run_distributed(_train, world, world, _config(None, opt_path))
    nvme = run_distributed(_train, world, world, _config(str(tmp_path), opt_path))
    for a, b in zip(cpu, nvme, strict=True):
        assert a["losses"] == b["losses"]
        for k in a["weights"]:
            assert torch.equal(a["weights"][k], b["weights"][k]), k
        stats = b["stats"]
        assert stats.reads > 0 and stats.writes > 0, stats
        # Reads were started ahead of the gathers (trace order) and the gathers found them in a buffer.
        assert stats.read_ahead > 0 and stats.read_ahead_used > 0, stats
    for rank, r in enumerate(nvme):
        folder = tmp_path / "zero_stage_3" / "bfloat16params" / f"rank{rank}"
        assert r["files"] and all(Path(p).parent == folder for p in r["files"]), r["files"]
        assert all(Path(p).name.endswith("_param.tensor.swp") and Path(p).name[0].isdigit() for p in r["files"])
