"""Activation offload and tiled loss on a CUDA device: asynchronous copies give the same gradients, and the
device bytes held between forward and backward drop by the offloaded inputs."""

from __future__ import annotations

import gc

import pytest
import torch

from deepspeed._core.engine import activation_checkpoint as core
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing import checkpointing as ck
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

pytestmark = pytest.mark.gpu

LAYERS, ROWS, WIDTH = 6, 4096, 1024


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> core.ActivationCheckpointState:
    state = core.ActivationCheckpointState()
    monkeypatch.setattr(core, "_STATE", state)
    return state


def _run(layers: torch.nn.ModuleList, offload: bool) -> tuple[int, list[torch.Tensor]]:
    ck.configure(None, checkpoint_in_cpu=offload)
    accel = get_accelerator()
    torch.manual_seed(1)
    x = torch.randn(ROWS, WIDTH, device=accel.current_device_name(), requires_grad=True)
    accel.synchronize()
    before = accel.memory_allocated()
    h = x
    for layer in layers:
        h = ck.checkpoint(layer, h)
    accel.synchronize()
    held = accel.memory_allocated() - before
    h.float().square().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in layers.parameters()]
    layers.zero_grad(set_to_none=True)
    return held, grads


def test_offload_frees_device_bytes_and_keeps_gradients() -> None:
    torch.manual_seed(0)
    device = get_accelerator().current_device_name()
    layers = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()) for _ in range(LAYERS)
    ).to(device)
    held_plain, expected = _run(layers, False)
    held_offload, got = _run(layers, True)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    per_input = ROWS * WIDTH * 4
    # Without offload the inputs of layers 1..L-1 and the output stay (x is held by the caller); with it one
    # input stays (the last, needed first) plus at most one copy still in flight.
    assert held_plain >= LAYERS * per_input
    assert held_offload <= 3 * per_input
    stats = core.current_state().offloader().stats
    # Every input but the last goes down; each comes back up, except one whose copy was still in flight when the
    # backward began: its device tensor is used as it is.
    assert stats.offloaded_tensors == LAYERS - 1
    assert LAYERS - 2 <= stats.restored_tensors <= LAYERS - 1
    assert stats.kept_last_tensors == 1


def test_offload_buffers_are_registered_at_their_own_size_and_copy_asynchronously() -> None:
    from deepspeed._core.comm import page_locked

    gc.collect()  # an earlier test's pool or shards, collected later, would unregister in the middle of the count
    before = page_locked.registered_bytes()
    data = page_locked.lock_pages(ROWS * WIDTH * 4 + 1)  # a power of two plus one byte: rounding would double it
    assert page_locked.registered_bytes() - before == ROWS * WIDTH * 4 + 4096
    assert page_locked.is_page_locked(data)
    source = torch.randn(ROWS * WIDTH, device=get_accelerator().current_device_name())
    host = data[: source.numel() * 4].view(torch.float32)
    host.copy_(source, non_blocking=True)
    back = host.to(source.device, non_blocking=True)
    get_accelerator().synchronize()
    assert torch.equal(back, source)
    page_locked.unlock_pages(data)
    assert page_locked.registered_bytes() == before
    again = page_locked.lock_pages(ROWS * WIDTH * 4 + 1)  # the same pages may be registered again
    assert page_locked.registered_bytes() - before == ROWS * WIDTH * 4 + 4096
    page_locked.unlock_pages(again)


def test_tiled_loss_peak_stays_below_full_logits() -> None:
    device = get_accelerator().current_device_name()
    vocab, rows, hidden = 32000, 8192, 256
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False, device=device)
    x = torch.randn(1, rows, hidden, device=device, requires_grad=True)
    y = torch.randint(0, vocab, (1, rows), device=device)

    def loss_fn(module: torch.nn.Linear, xt: torch.Tensor, yt: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(module(xt).float(), yt, reduction="sum")

    accel = get_accelerator()
    accel.synchronize()
    accel.reset_peak_memory_stats()
    base = accel.memory_allocated()
    loss = TiledFusedLogitsLoss.apply(loss_fn, head, x, y, None, 16, [head.weight], "sum")
    (loss / rows).backward()
    accel.synchronize()
    peak = accel.max_memory_allocated() - base
    full_logits = rows * vocab * 4
    assert peak < full_logits / 2, (peak, full_logits)
    tiled_grad = head.weight.grad.clone()
    head.weight.grad = None
    (loss_fn(head, x[0], y[0]) / rows).backward()
    torch.testing.assert_close(tiled_grad, head.weight.grad, rtol=1e-4, atol=1e-6)


def test_pinned_parameter_shards_are_registered_and_let_go_with_the_shard() -> None:
    from deepspeed._core.comm import page_locked
    from deepspeed._core.params import placement

    gc.collect()  # see above: nothing earlier may unregister during the count
    before = page_locked.registered_bytes()
    where = placement.ShardPlacement(torch.device("cpu"), placement.Pinning.PINNED)
    device = torch.device(get_accelerator().current_device_name())
    shard = placement.allocate_shard(3 * 2**20 + 7, torch.bfloat16, device, where)
    assert page_locked.is_page_locked(shard) and not shard.any()
    assert page_locked.registered_bytes() - before == -(-(3 * 2**21 + 14) // 4096) * 4096
    up = shard.to(device, non_blocking=True)
    get_accelerator().synchronize()
    assert not up.any()
    del shard
    gc.collect()
    assert page_locked.registered_bytes() == before
