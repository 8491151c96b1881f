"""Parameters on NVMe on a real device, with the device far behind the host (world size 1).

Before each layer a burst of large matmuls is queued on the compute stream, so the host-to-device copies out of
the page-locked swap buffers run late. With two buffers for eight layers' weights (the biases, under 1 MiB, stay
in host memory) every buffer is refilled from disk many times per pass; a refill that did not wait for the copy
still reading the buffer would hand a layer another layer's weights. Outputs and input gradients must equal an
unsharded reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from deepspeed._core.comm.groups import ShardGroup
from deepspeed._core.config.plan import AioPolicy, LeanPolicy, OffloadDevice, ParamOffloadPolicy, Stage3Policy
from deepspeed._core.params.manager import ParamStorage, ZeroParamManager
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.op_builder.async_io import AsyncIOBuilder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not AsyncIOBuilder().is_compatible(), reason="the async_io op cannot be built here"),
]

LAYERS, WIDTH = 8, 1024


def _model(device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).to(device)


def run_swapped(device: torch.device, folder: Path) -> dict:
    """One forward and backward of the swapped model and of the reference; their outputs and input gradients."""
    x = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(5)).to(device)
    ref = _model(device)
    xr = x.clone().requires_grad_(True)
    ref(xr).square().sum().backward()
    model = _model(device)
    policy = ParamOffloadPolicy(
        device=OffloadDevice.NVME, nvme_path=str(folder), buffer_count=2, buffer_size=WIDTH * WIDTH, max_in_cpu=0
    )
    manager = ZeroParamManager(
        model,
        ShardGroup(None, 0, 1),
        Stage3Policy(param_persistence_threshold=0),
        LeanPolicy(),
        storage=ParamStorage(offload_param=policy, aio=AioPolicy()),
    )
    burn = torch.randn(2048, 2048, device=device)

    def slow(module: nn.Module, args: tuple) -> None:
        for _ in range(4):
            torch.mm(burn, burn)  # queued on the compute stream; the host does not wait

    handles = [layer.register_forward_pre_hook(slow) for layer in model]
    out = []
    for _ in range(2):  # the second pass replays the trace: reads ahead of the gathers
        xs = x.clone().requires_grad_(True)
        y = model(xs)
        y.square().sum().backward()
        out.append((y.detach(), xs.grad))
    for h in handles:
        h.remove()
    stats, swapped = manager.gatherer.swapper.stats, len(manager.gatherer.swapper.entries)
    manager.destroy()
    return {"ref": (ref(x).detach(), xr.grad), "swapped": out, "stats": stats, "files": swapped}


def test_swap_buffers_are_not_refilled_under_a_pending_copy(tmp_path: Path) -> None:
    device = torch.device(get_accelerator().current_device_name())
    r = run_swapped(device, tmp_path)
    get_accelerator().synchronize()
    for y, g in r["swapped"]:
        assert torch.equal(y, r["ref"][0]) and torch.equal(g, r["ref"][1])
    assert r["files"] == LAYERS  # the 4 MiB weights; the 4 KiB biases stay in host memory
    assert r["stats"].reads >= 2 * LAYERS, r["stats"]  # two passes, the weight of every layer
