"""Exact-size page-locked host buffers ([Note: exact page-locking]) and the activation pool that uses them.

The accelerator is replaced by a recorder, so the test sees which ranges are registered and unregistered: each is
page-aligned, a whole number of pages, never rounded to a power of two, and unregistered before the pool drops it.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from deepspeed._core.comm import page_locked
from deepspeed._core.engine import activation_offload
from deepspeed._core.engine.activation_offload import HostMemory, PinnedHostPool


class _Accelerator:
    """A CUDA-like accelerator that records what is registered, and can refuse."""

    def __init__(self, accept: bool = True) -> None:
        self.accept = accept
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.pinned: list[torch.Tensor] = []

    def device_name(self) -> str:
        return "cuda"

    def register_host_memory(self, tensor: torch.Tensor) -> bool:
        if self.accept:
            self.registered[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        return self.accept

    def unregister_host_memory(self, tensor: torch.Tensor) -> None:
        self.unregistered.append(tensor.data_ptr())
        del self.registered[tensor.data_ptr()]

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        self.pinned.append(tensor)
        return tensor


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> _Accelerator:
    fake = _Accelerator()
    monkeypatch.setattr(page_locked, "get_accelerator", lambda: fake)
    monkeypatch.setattr(page_locked, "_REGISTERED", {})
    return fake


def test_without_an_accelerator_the_buffer_is_plain_memory_of_whole_pages() -> None:
    data = page_locked.lock_pages(5000)
    assert data.dtype == torch.uint8 and data.numel() == 8192
    page_locked.unlock_pages(data)  # nothing registered: nothing to do
    assert page_locked.registered_bytes() == 0


@pytest.mark.parametrize("nbytes", [1, 4096, 700_000, 3 * 4096 + 1])
def test_a_registered_buffer_is_page_aligned_whole_pages_and_not_rounded_to_a_power_of_two(
    runtime: _Accelerator, nbytes: int
) -> None:
    data = page_locked.lock_pages(nbytes)
    pages = -(-nbytes // 4096)
    assert data.numel() == pages * 4096  # 700_000 bytes: 171 pages, not the 1 MiB a power of two would take
    assert runtime.registered == {data.data_ptr(): pages * 4096}
    assert data.data_ptr() % 4096 == 0
    assert page_locked.registered_bytes() == pages * 4096
    page_locked.unlock_pages(data)
    assert runtime.unregistered == [data.data_ptr()] and not runtime.registered
    page_locked.unlock_pages(data)  # a second release is a no-op
    assert runtime.unregistered == [data.data_ptr()]


def test_a_refused_registration_falls_back_to_the_caching_allocator(runtime: _Accelerator) -> None:
    runtime.accept = False
    data = page_locked.lock_pages(10_000)
    assert runtime.pinned and runtime.pinned[-1] is data and not runtime.registered
    page_locked.unlock_pages(data)
    assert runtime.unregistered == []


def test_the_activation_pool_registers_exact_sizes_and_unregisters_what_it_retires(runtime: _Accelerator) -> None:
    assert activation_offload.lock_pages is page_locked.lock_pages
    pool = PinnedHostPool(2, HostMemory.PINNED)
    a, b = pool.take(5000), pool.take(100)
    assert a is not None and b is not None
    assert sorted(runtime.registered.values()) == [4096, 8192]
    pool.give(a, None)
    pool.give(b, None)
    big = pool.take(100_000)  # full: the largest free buffer is retired for a larger one
    assert big is not None
    assert a.data.data_ptr() in runtime.unregistered
    assert sorted(runtime.registered.values()) == [4096, 102400]
    pool.release()
    assert not runtime.registered and pool.buffers == [] and pool.free == []


def test_a_dropped_pool_unregisters_its_buffers(runtime: _Accelerator) -> None:
    pool: Any = PinnedHostPool(4, HostMemory.PINNED)
    assert pool.take(50_000) is not None and pool.take(9000) is not None
    assert len(runtime.registered) == 2
    del pool
    gc.collect()
    assert not runtime.registered and len(runtime.unregistered) == 2


def test_a_self_releasing_tensor_is_unregistered_when_collected_and_its_views_stay_valid(
    runtime: _Accelerator,
) -> None:
    shard = page_locked.locked_empty(1000, torch.bfloat16)
    assert shard.dtype == torch.bfloat16 and shard.numel() == 1000
    assert list(runtime.registered.values()) == [4096]  # 2000 bytes: one page, not a power-of-two block
    shard.fill_(3.0)
    view = shard[10:20]
    del shard
    gc.collect()
    assert not runtime.registered and len(runtime.unregistered) == 1
    assert torch.equal(view, torch.full((10,), 3.0, dtype=torch.bfloat16))  # the memory lives on, unpinned


def test_pinned_host_parameter_shards_are_registered_at_their_own_size(runtime: _Accelerator) -> None:
    from deepspeed._core.params import placement

    where = placement.ShardPlacement(torch.device("cpu"), placement.Pinning.PINNED)
    # A compute device other than the host is what asks for page-locking; "meta" stands in for the accelerator.
    shard = placement.allocate_shard(300_000, torch.bfloat16, torch.device("meta"), where)
    assert shard.device.type == "cpu" and shard.numel() == 300_000 and not shard.any()
    assert list(runtime.registered.values()) == [600_000 + (-600_000 % 4096)]  # not the 1 MiB a power of two takes
    del shard
    gc.collect()
    assert not runtime.registered


def test_offloaded_states_sit_in_exact_page_locked_copies_until_the_reload(
    monkeypatch: pytest.MonkeyPatch, runtime: _Accelerator
) -> None:
    from deepspeed._core.engine import state_offload

    monkeypatch.setattr(state_offload, "get_accelerator", lambda: runtime)
    weight = torch.nn.Parameter(torch.arange(6000, dtype=torch.float32))
    optimizer = torch.optim.Adam([weight])
    weight.grad = torch.ones_like(weight)
    optimizer.step()
    expected = {k: v.clone() for k, v in optimizer.state[weight].items()}
    offloader = state_offload.StateOffloader()
    # torch.device("cpu", 0) is not the tensors' torch.device("cpu"): the move runs on a machine without a GPU.
    kinds = {state_offload.StateKind.OPTIM_STATES, state_offload.StateKind.HP_PARAMS}
    offloader.offload(optimizer, kinds, torch.device("cpu", 0), torch.float32, False)
    assert sorted(runtime.registered.values()) == [24576, 24576, 24576]  # weight, exp_avg, exp_avg_sq: 24,000 B
    moved = [weight, *(v for v in optimizer.state[weight].values() if v.dim() > 0)]
    assert {t.data_ptr() for t in moved} == set(runtime.registered)  # each one lives in its registered copy
    offloader.reload(False)
    assert not runtime.registered and len(runtime.unregistered) == 3
    for key, value in expected.items():
        assert torch.equal(optimizer.state[weight][key], value)


def test_a_registered_buffer_and_views_inside_it_read_as_page_locked(runtime: _Accelerator) -> None:
    # Recent PyTorch's is_pinned() asks its caching host allocator only, which never saw a registration.
    data = page_locked.lock_pages(3 * page_locked.PAGE)
    typed = page_locked.locked_empty(100, torch.bfloat16)
    assert page_locked.is_page_locked(data) and page_locked.is_page_locked(data[page_locked.PAGE :])
    assert page_locked.is_page_locked(typed)
    assert not page_locked.is_page_locked(torch.empty(64))
    page_locked.unlock_pages(data)
    assert not page_locked.is_page_locked(data)
