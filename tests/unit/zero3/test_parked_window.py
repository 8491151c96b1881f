"""ParkedWindow ([Note: parked grads]): a step chunk assembled from parked regions, side tensors and the
accumulator (or zeros) in the gaps, through two alternating buffers."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from deepspeed._core.grads.accumulator import ChunkedGradShard
from deepspeed._core.grads.parked import Parked, ParkedWindow

NUMEL, CHUNK = 40, 16


def _region(offset: int, values: torch.Tensor, side: bool = False) -> Parked:
    state = SimpleNamespace(shard=values.clone() if not side else torch.empty_like(values), ds_id=offset)
    return Parked(state, 0, offset, values.clone() if side else None)  # type: ignore[arg-type]


def _assemble(window: ParkedWindow) -> torch.Tensor:
    pieces, outs = [], []
    for start in range(0, NUMEL, CHUNK):
        end = min(start + CHUNK, NUMEL)
        out = window.window(start, end)
        outs.append(out)
        pieces.append(out.clone())
        window.release(start, end)
    return torch.cat(pieces), outs


def test_regions_side_tensors_and_gaps_make_the_gradient() -> None:
    full = torch.arange(1, NUMEL + 1, dtype=torch.float32)
    acc = ChunkedGradShard(NUMEL, CHUNK, torch.float32, "cpu")
    acc.write(20, full[20:26])  # an evicted region: its values live in the accumulator
    regions = [_region(0, full[0:10]), _region(10, full[10:20], side=True), _region(30, full[30:40])]
    buffers = [torch.full((CHUNK,), float("nan")), torch.full((CHUNK,), float("nan"))]
    got, outs = _assemble(ParkedWindow(acc, regions, buffers, CHUNK, NUMEL))
    want = full.clone()
    want[26:30] = 0  # no region and no accumulator value: zeros
    assert torch.equal(got, want), got
    # The buffers alternate, so the chunk being stepped is never the one the next read fills.
    assert outs[0].data_ptr() != outs[1].data_ptr() and outs[0].data_ptr() == outs[2].data_ptr()


def test_a_window_without_parked_regions_is_the_accumulators_own() -> None:
    acc = ChunkedGradShard(NUMEL, CHUNK, torch.float32, "cpu")
    acc.write(0, torch.ones(CHUNK))
    window = ParkedWindow(acc, [_region(32, torch.ones(8))], [torch.empty(CHUNK), torch.empty(CHUNK)], CHUNK, NUMEL)
    first = window.window(0, CHUNK)
    assert first.data_ptr() == acc.window(0, CHUNK).data_ptr()  # a view of the chunk: nothing copied


@pytest.mark.gpu
def test_device_regions_arrive_through_prefetched_non_blocking_copies() -> None:
    """Parked shards on the device (optimizer offload without offload_param): each chunk's device pieces are
    copied ahead, while the previous chunk is stepped, into page-locked buffers."""
    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().current_device_name())
    numel, chunk = 1 << 20, 1 << 18
    full = torch.randn(numel, dtype=torch.float32)
    acc = ChunkedGradShard(numel, chunk, torch.float32, "cpu")
    bounds = [0, 1000, 300_000, 300_001, 700_000, numel]
    regions = []
    for lo, hi in itertools.pairwise(bounds):
        region = _region(lo, full[lo:hi])
        region.state.shard = full[lo:hi].to(device)
        regions.append(region)
    buffers = [torch.empty(chunk, pin_memory=True) for _ in range(2)]
    window = ParkedWindow(acc, regions, buffers, chunk, numel)
    pieces = []
    for start in range(0, numel, chunk):
        out = window.window(start, min(start + chunk, numel))
        pieces.append(out.clone())
        out.mul_(2.0)  # the step scales its chunk in place; the next chunk's prefetch must not see it
    assert torch.equal(torch.cat(pieces), full)
    assert len(window._prefetched) == 0


def test_convert_into_writes_the_scaled_fp32_gradient_in_one_pass() -> None:
    full = torch.arange(1, NUMEL + 1, dtype=torch.float32)
    acc = ChunkedGradShard(NUMEL, CHUNK, torch.bfloat16, "cpu")
    acc.write(20, full[20:26])
    regions = [
        _region(0, full[0:10].bfloat16()),
        _region(10, full[10:20].bfloat16(), side=True),
        _region(30, full[30:40].bfloat16()),
    ]
    window = ParkedWindow(acc, regions, [torch.empty(CHUNK, dtype=torch.bfloat16) for _ in range(2)], CHUNK, NUMEL)
    out = torch.full((CHUNK,), float("nan"))
    got = []
    for start in range(0, NUMEL, CHUNK):
        end = min(start + CHUNK, NUMEL)
        assert window.convert_into(start, end, out[: end - start], 0.5)
        got.append(out[: end - start].clone())
    want = full * 0.5
    want[26:30] = 0
    assert torch.equal(torch.cat(got), want)
    assert not ParkedWindow(acc, [], window.buffers, CHUNK, NUMEL).convert_into(0, CHUNK, out, 1.0)


def test_restoring_a_shard_from_a_master_on_another_device_goes_through_the_given_path() -> None:
    """An evicted shard gets its values back from the master; across devices (a host master, a device shard) that
    goes through the optimizer's pipelined path, on one device through a plain copy."""
    from deepspeed._core.grads.parked import ParkedGrads

    calls = []

    def restore(shard: torch.Tensor, values: torch.Tensor) -> None:
        calls.append((shard.numel(), values.device.type))
        shard.fill_(7)

    master = torch.arange(10, dtype=torch.float32)
    for where, expected in (("meta", [(4, "meta")]), ("cpu", [])):
        calls.clear()
        source = master.to(where)
        noop = lambda *a: None  # noqa: E731
        parked = ParkedGrads(lambda g, s=source: s, noop, noop, noop, torch.float32, restore)
        state = SimpleNamespace(shard=torch.zeros(4, dtype=torch.bfloat16))
        parked._restore(Parked(state, 0, 3))  # type: ignore[arg-type]
        assert calls == expected
        want = torch.full((4,), 7.0) if where == "meta" else master[3:7]
        assert torch.equal(state.shard.float(), want)


def _side_store(device: torch.device, pinning: object) -> tuple:
    from deepspeed._core.grads.parked import ParkedGrads

    copies = []
    master = torch.zeros(64)
    noop = lambda *a: None  # noqa: E731
    parked = ParkedGrads(
        lambda g: master,
        noop,
        lambda target, piece: copies.append(target.copy_(piece, non_blocking=True)),
        noop,
        torch.float32,
        pinning=pinning,  # type: ignore[arg-type]
    )
    sides = []
    for step in range(2):
        state = SimpleNamespace(
            shard=torch.zeros(5, device=device), ds_id=3, is_persistent=True, mark_values=lambda: None
        )
        piece = torch.full((5,), float(step + 1), device=device)
        parked.park(state, 0, 8, piece)  # type: ignore[arg-type]
        sides.append(parked.parked[3].side)
        torch.testing.assert_close(parked.parked[3].grad().cpu(), piece.cpu())
        parked.forget()
    return sides, copies


def test_persistent_gradients_reuse_one_side_tensor_per_parameter() -> None:
    """A persistent parameter's gradient waits in a host side tensor that later steps reuse (no allocation per
    backward); on one device it is a plain copy."""
    from deepspeed._core.comm.pinned_pool import Pinning

    sides, copies = _side_store(torch.device("cpu"), Pinning.PAGE_LOCKED)
    assert sides[0] is sides[1] and not copies


@pytest.mark.gpu
def test_persistent_gradients_go_down_into_page_locked_side_tensors_without_blocking() -> None:
    from deepspeed._core.comm.pinned_pool import Pinning
    from deepspeed.accelerator import get_accelerator

    sides, copies = _side_store(torch.device(get_accelerator().current_device_name()), Pinning.PAGE_LOCKED)
    assert sides[0] is sides[1] and sides[0].is_pinned() and len(copies) == 2
