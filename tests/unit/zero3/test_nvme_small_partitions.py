"""Which parameter partitions go to NVMe swap files ([Note: nvme params]): one under max(1 MiB, ``aio.block_size``)
bytes stays in host memory and does not count toward ``max_in_cpu``; larger ones are swapped. One rank, fp32 on
the host, in process: the manager's forward and backward equal an unsharded reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from deepspeed._core.comm.groups import ShardGroup
from deepspeed._core.config.plan import AioPolicy, LeanPolicy, OffloadDevice, ParamOffloadPolicy, Stage3Policy
from deepspeed._core.params.manager import ParamStorage, ZeroParamManager
from deepspeed._core.params.param import zero_state
from deepspeed._core.params.swap import MIN_AIO_BYTES, swap_folder
from deepspeed.ops.op_builder.async_io import AsyncIOBuilder

pytestmark = pytest.mark.skipif(not AsyncIOBuilder().is_compatible(), reason="the async_io op cannot be built here")

MIB = 1024**2
BIG = "0.weight"  # 512 x 1024 fp32: 2 MiB
EXACT = "2.weight"  # 256 x 1024 fp32: exactly 1 MiB (swapped: the rule keeps partitions *under* the threshold)
UNDER = "3.weight"  # 1023 x 256 fp32: 4 KiB under 1 MiB


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.LayerNorm(1024), nn.Linear(1024, 256), nn.Linear(256, 1023))


def _run(folder: Path, block_size: int = MIB, max_in_cpu: int = 0, buffer_size: int = 1 << 20) -> dict:
    """Build the manager, run forward and backward twice; what was swapped and what stayed."""
    policy = ParamOffloadPolicy(
        device=OffloadDevice.NVME, nvme_path=str(folder), buffer_count=2, buffer_size=buffer_size, max_in_cpu=max_in_cpu
    )
    model, ref = _model(), _model()
    manager = ZeroParamManager(
        model,
        ShardGroup(None, 0, 1),
        Stage3Policy(param_persistence_threshold=0),
        LeanPolicy(),
        storage=ParamStorage(offload_param=policy, aio=AioPolicy(block_size=block_size)),
    )
    swapper = manager.gatherer.swapper
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # the second pass replays the trace: reads ahead of the gathers
        expected = ref(x)
        expected.square().sum().backward()
        y = model(x)
        y.square().sum().backward()
        assert torch.equal(y, expected)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    states = {name: zero_state(p) for name, p in model.named_parameters()}
    swapped = {name for name, s in states.items() if s.ds_id in swapper.entries}
    rank0 = swap_folder(str(folder), torch.float32, 0)
    kept_bytes = sum(s.shard.numel() * s.shard.element_size() for n, s in states.items() if n not in swapped)
    out = {
        "swapped": swapped,
        "files": sorted(str(f.relative_to(folder)) for f in folder.rglob("*") if f.is_file()),
        "expected_files": sorted(
            str(rank0.relative_to(folder) / f"{states[n].ds_id}_param.tensor.swp") for n in swapped
        ),
        "kept_bytes": kept_bytes,
        "resident_bytes": swapper.resident_bytes,
        "host_bytes": swapper.host_bytes(),
        "pool_bytes": swapper.pool_bytes(),
        "max_in_cpu_used": swapper.max_in_cpu_used,
        "reads": swapper.stats.reads,
    }
    manager.destroy()
    return out


def test_small_partitions_stay_in_host_memory_large_ones_are_swapped(tmp_path: Path) -> None:
    assert MIN_AIO_BYTES == MIB  # upstream's minimum
    r = _run(tmp_path)
    # Biases, the norm and the weight just under 1 MiB stay; the 2 MiB and the exactly-1 MiB weights are swapped.
    assert r["swapped"] == {BIG, EXACT}, r["swapped"]
    assert r["files"] == r["expected_files"], r  # no swap file for a kept partition
    assert r["reads"] >= 2 * 2, r  # both swapped weights read back in each of the two passes
    assert r["resident_bytes"] == r["kept_bytes"] > 1023 * 256 * 4, r  # host accounting includes small partitions
    assert r["host_bytes"] == r["pool_bytes"] + r["kept_bytes"], r
    assert r["max_in_cpu_used"] == 0, r


@pytest.mark.parametrize(("block_size", "swapped"), [(2 * MIB, {BIG}), (4 * MIB, set())])
def test_aio_block_size_above_1mib_raises_the_threshold(block_size: int, swapped: set, tmp_path: Path) -> None:
    r = _run(tmp_path, block_size=block_size)
    assert r["swapped"] == swapped, r["swapped"]
    assert r["files"] == r["expected_files"], r


def test_small_kept_partitions_do_not_use_up_max_in_cpu(tmp_path: Path) -> None:
    # Room for the 1 MiB weight exactly. The first bias and the norm (3072 elements) come before it in the order
    # partitions are decided: counted against max_in_cpu they would push it out to a swap file.
    r = _run(tmp_path, max_in_cpu=256 * 1024)
    assert r["swapped"] == {BIG}, r["swapped"]
    assert r["max_in_cpu_used"] == 256 * 1024, r
    assert r["resident_bytes"] == r["kept_bytes"], r


def test_buffer_size_check_ignores_small_partitions(tmp_path: Path) -> None:
    # Every kept partition is larger than buffer_size; only the two swapped ones are named.
    with pytest.raises(ValueError, match=r"buffer_size=1000 elements is smaller than 2 parameter partition\(s\)"):
        _run(tmp_path, buffer_size=1000)
    assert not (tmp_path / "zero_stage_3").exists()  # refused before anything is written
    _run(tmp_path, buffer_size=512 * 1024)  # the largest swapped partition fits
