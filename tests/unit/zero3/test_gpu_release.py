"""Report 3 on a real device: gathered memory under a deliberately slow compute stream (world size 1).

Before each layer the test queues a burst of large matmuls on the compute stream, so the device falls far behind
the host. With stream-ordered release, memory held at every layer boundary stays at the current layer plus the
prefetch window (plus the flat all-gather buffers still in flight); the deferred (record_stream-like) baseline keeps
every released layer until the device catches up. Outputs and gradients must equal an unsharded reference,
which also checks that no freed block was reused too early.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepspeed._core.comm.groups import ShardGroup
from deepspeed._core.config.plan import LeanPolicy, Stage3Policy
from deepspeed._core.params.manager import ParamStorage, ZeroParamManager
from deepspeed._core.params.param import FullStorage
from deepspeed.accelerator import get_accelerator

pytestmark = pytest.mark.gpu

LAYERS, WIDTH = 8, 2048
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4


def _input(device: torch.device) -> torch.Tensor:
    return torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(5)).to(device)


def _model(device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).to(device)


def _run(lean: bool, prefetch_layers: int) -> dict:
    acc = get_accelerator()
    device = torch.device(acc.current_device_name())
    model = _model(device)
    policy = Stage3Policy(prefetch_bucket_size=prefetch_layers * (WIDTH * WIDTH + WIDTH), param_persistence_threshold=0)
    # SEPARATE: one rank would otherwise gather into the shards themselves and no gathered memory would exist.
    manager = ZeroParamManager(
        model,
        ShardGroup(None, 0, 1),
        policy,
        LeanPolicy(stream_ordered_release=lean),
        storage=ParamStorage(single_rank=FullStorage.SEPARATE),
    )
    burn = torch.randn(4096, 4096, device=device)
    held: list[int] = []

    def slow_then_measure(module: nn.Module, args: tuple) -> None:
        for _ in range(8):
            torch.mm(burn, burn)  # queued on the compute stream; the host does not wait
        held.append(acc.memory_allocated())

    handles = [layer.register_forward_pre_hook(slow_then_measure) for layer in model]
    x = _input(device)
    acc.synchronize()
    outputs, grads = [], {}
    manager.on_grad_ready(lambda p, s, g: grads.__setitem__(s.ds_id, g.detach().cpu()))
    for _ in range(2):
        held.clear()
        floor = acc.memory_allocated()
        out = model(x)
        out.square().mean().backward()
        outputs.append(out.detach().cpu())
        acc.synchronize()
    peak_layers = (max(held) - floor) / LAYER_BYTES
    for handle in handles:
        handle.remove()
    manager.destroy()
    return {"peak_layers": peak_layers, "out": outputs[-1], "grads": [grads[k] for k in sorted(grads)]}


def _reference() -> tuple[torch.Tensor, list[torch.Tensor]]:
    device = torch.device(get_accelerator().current_device_name())
    model = _model(device)
    out = model(_input(device))
    out.square().mean().backward()
    return out.detach().cpu(), [p.grad.cpu() for p in model.parameters()]


def test_stream_ordered_release_holds_current_plus_window_under_a_slow_stream() -> None:
    lean = _run(True, 1)
    baseline = _run(False, 1)
    out, grads = _reference()
    for result in (lean, baseline):
        torch.testing.assert_close(result["out"], out)
        for got, want in zip(result["grads"], grads, strict=True):
            torch.testing.assert_close(got, 2 * want)  # two steps accumulate without zeroing
    print(f"peak gathered layers: stream-ordered {lean['peak_layers']:.2f}, deferred {baseline['peak_layers']:.2f}")
    # current + one prefetched layer (its flat buffer in flight), with slack for activations
    assert lean["peak_layers"] <= 3.5, lean["peak_layers"]
    assert baseline["peak_layers"] >= LAYERS - 1, baseline["peak_layers"]


def test_offloaded_shards_stay_pinned_on_host_and_gather_to_the_device() -> None:
    from deepspeed._core.config.plan import OffloadDevice, OffloadPolicy
    from deepspeed._core.params.init_context import InitPlan, ZeroInitContext
    from deepspeed._core.params.placement import Pinning, ShardPlacement

    device = torch.device(get_accelerator().current_device_name())
    placement = ShardPlacement(torch.device("cpu"), Pinning.PINNED)
    torch.manual_seed(0)
    with ZeroInitContext(InitPlan(ShardGroup(None, 0, 1), torch.float, device, placement)):
        model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).to(device)
    late = nn.Linear(8, 8).to(device)  # built outside Init: partitioned (and offloaded) by the manager
    offload = OffloadPolicy(device=OffloadDevice.CPU, pin_memory=True)
    manager = ZeroParamManager(
        nn.Sequential(model, late),
        ShardGroup(None, 0, 1),
        Stage3Policy(param_persistence_threshold=0),
        LeanPolicy(),
        storage=ParamStorage(offload_param=offload),
    )
    from deepspeed._core.comm.page_locked import is_page_locked

    for param in manager.module.parameters():
        assert param.ds_tensor.device.type == "cpu" and is_page_locked(param.ds_tensor)
    x = torch.randn(4, 64, device=device)
    assert manager.module(x).device.type == device.type
    out = model(x)  # the Init-built part alone, against the unsharded reference
    torch.testing.assert_close(out, reference(x))
    out.sum().backward()
    manager.gatherer.sync_shard_reads()
    assert all(p.ds_status.name == "NOT_AVAILABLE" for p in manager.module.parameters())
    manager.destroy()
