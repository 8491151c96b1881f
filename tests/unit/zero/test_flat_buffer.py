"""FlatBuffer views and storage tricks, and the in-place flatten's memory bound, on CPU tensors."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from deepspeed._core.layout.flat_buffer import (
    FlatBuffer,
    alloc_storage,
    free_storage,
    storage_nbytes,
)
from deepspeed._core.layout.inplace_flatten import (
    FlattenEvent,
    FlattenPath,
    FlattenStage,
    flatten_params,
    flatten_params_inplace,
    flatten_params_via_host,
    torch_flatten_into,
)
from deepspeed._core.layout.shards import GroupLayout, Range, plan_group, plan_segments

CPU = torch.device("cpu")


def _params(
    shapes: list[tuple[int, ...]], seed: int = 0, dtype: torch.dtype = torch.float32
) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _layout_of(params: list[torch.Tensor], world: int = 4) -> GroupLayout:
    return plan_group([tuple(p.shape) for p in params], world)


SHAPES = [(4, 6), (10,), (3, 3, 3), (1,), (0,), (40,), (2, 5), (17,)]


class TestFlatBuffer:
    def test_views_alias_the_buffer(self) -> None:
        layout = plan_group(SHAPES, 3)
        buf = FlatBuffer.allocate(layout, CPU, torch.float32)
        buf.tensor.copy_(torch.arange(layout.padded_numel, dtype=torch.float32))
        for slot in layout.slots:
            view = buf.view(slot)
            assert tuple(view.shape) == slot.shape
            assert torch.equal(view.reshape(-1), buf.tensor[slot.range.as_slice()])
            if slot.numel:
                view.reshape(-1)[0] = -7.0
                assert buf.tensor[slot.offset] == -7.0

    def test_padding_is_zeroed(self) -> None:
        layout = plan_group([(5,)], 4)
        plan = plan_segments(layout, 2)
        buf = FlatBuffer.allocate(layout, CPU, torch.float32, plan)
        assert len(buf.segments) == 1 and layout.padding == 3
        assert torch.equal(buf.tensor[5:], torch.zeros(3))

    def test_free_alloc_storage_round_trip(self) -> None:
        layout = plan_group(SHAPES, 2)
        buf = FlatBuffer.allocate(layout, CPU, torch.float32)
        nbytes = layout.padded_numel * 4
        view = buf.view(layout.slots[0])
        assert buf.nbytes() == nbytes and buf.is_allocated
        buf.free_storage()
        assert buf.nbytes() == 0 and not buf.is_allocated
        assert tuple(view.shape) == layout.slots[0].shape, "views keep their metadata while freed"
        buf.alloc_storage()
        assert buf.nbytes() == nbytes
        buf.tensor.fill_(3.0)
        assert torch.equal(view, torch.full(layout.slots[0].shape, 3.0)), "old views see the re-grown storage"

    def test_free_storage_helpers_reject_offset_views(self) -> None:
        base = torch.zeros(8)
        with pytest.raises(ValueError):
            free_storage(base[2:])
        free_storage(base)
        assert storage_nbytes(base) == 0
        alloc_storage(base)
        assert storage_nbytes(base) == 32

    def test_install_param_views_links_both_ways(self) -> None:
        params = _params(SHAPES)
        expected = [p.detach().clone() for p in params]
        layout = _layout_of(params)
        buf = FlatBuffer.allocate(layout, CPU, torch.float32)
        for slot, p in zip(layout.slots, params, strict=True):
            buf.view(slot).copy_(p.data)
        buf.install_param_views(params)
        assert all(torch.equal(p, e) for p, e in zip(params, expected, strict=True))
        buf.tensor.mul_(2.0)
        assert torch.equal(params[0].data, expected[0] * 2)
        with torch.no_grad():
            params[1].zero_()
        assert torch.equal(buf.view(layout.slots[1]), torch.zeros(SHAPES[1]))

    def test_partitions_across_segments(self) -> None:
        layout = plan_group(SHAPES, 4)
        buf = FlatBuffer.allocate(layout, CPU, torch.float32, plan_segments(layout, 20))
        assert len(buf.segments) > 1
        reference = torch.arange(layout.padded_numel, dtype=torch.float32)
        buf.copy_in(Range(0, layout.padded_numel), reference)
        for rank in range(4):
            part = layout.partition(rank)
            assert torch.equal(torch.cat(buf.partition_pieces(rank)), reference[part.as_slice()])
            out = torch.empty(part.size)
            buf.copy_out(part, out)
            assert torch.equal(out, reference[part.as_slice()])
        spanning = [r for r in range(4) if len(buf.partition_pieces(r)) > 1]
        assert spanning, "the shapes were chosen so that some partition spans segments"
        with pytest.raises(ValueError, match="partition_pieces"):
            buf.partition_view(spanning[0])

    def test_partition_view_is_an_alias_when_contiguous(self) -> None:
        layout = plan_group(SHAPES, 4)
        buf = FlatBuffer.allocate(layout, CPU, torch.float32)
        part = buf.partition_view(2)
        part.fill_(9.0)
        assert torch.all(buf.tensor[layout.partition(2).as_slice()] == 9.0)


class _LiveBytes:
    """Observer measuring live bytes = original param storages (held here, so only resizing frees them)
    + every segment allocated so far, at each step of a flatten."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        unique = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in params if p.numel()}
        self.originals = list(unique.values())
        self.param_bytes = sum(s.nbytes() for s in self.originals)
        self.segment_bytes: list[int] = []
        self.peak = 0
        self.events: list[FlattenEvent] = []

    def __call__(self, event: FlattenEvent) -> None:
        self.events.append(event)
        if event.stage is FlattenStage.SEGMENT_ALLOCATED:
            self.segment_bytes.append(event.nbytes)
        live = sum(s.nbytes() for s in self.originals) + sum(self.segment_bytes)
        self.peak = max(self.peak, live)

    def count(self, stage: FlattenStage) -> int:
        return sum(e.stage is stage for e in self.events)


def _random_cases(count: int) -> Iterator[tuple[list[tuple[int, ...]], int, int | None]]:
    rng = random.Random(5)
    for _ in range(count):
        shapes = [
            (rng.randint(1, 30), rng.randint(1, 30)) if rng.random() < 0.5 else (rng.randint(0, 200),)
            for _ in range(rng.randint(1, 20))
        ]
        yield shapes, rng.choice([1, 2, 3, 8, 64]), rng.choice([None, 1, 50, 300, 1000])


class TestInplaceFlatten:
    @pytest.mark.parametrize("case", list(_random_cases(12)))
    def test_values_views_release_and_peak(self, case: tuple) -> None:
        shapes, world, chunk = case
        params = _params(shapes, seed=len(shapes))
        expected = [p.detach().clone() for p in params]
        layout = _layout_of(params, world)
        probe = _LiveBytes(params)
        buf = flatten_params_inplace(params, layout, CPU, chunk, observer=probe)
        assert all(torch.equal(p, e) for p, e in zip(params, expected, strict=True)), "values must survive"
        for slot, p in zip(layout.slots, params, strict=True):
            assert isinstance(p, torch.nn.Parameter)
            home = buf.segments[buf.plan.segment_of(slot).index]
            assert p.untyped_storage().data_ptr() == home.untyped_storage().data_ptr()
        assert all(s.nbytes() == 0 for s in probe.originals), "every old storage must be resized to 0"
        assert probe.count(FlattenStage.STORAGE_RETAINED) == 0
        bound = probe.param_bytes + max(probe.segment_bytes)
        assert probe.peak <= bound
        if chunk is not None and len(buf.segments) > 2:
            assert bound < 2 * probe.param_bytes, "a chunked flatten must beat the 2x single-buffer peak"
        assert torch.equal(
            torch.cat(buf.pieces(Range(layout.numel, layout.padded_numel)) or [torch.zeros(0)]),
            torch.zeros(layout.padding),
        )

    def test_measurement_sees_the_single_buffer_peak(self) -> None:
        """The probe can fail: one segment of the whole group costs params + params."""
        params = _params([(100,), (50, 2), (30,)])
        probe = _LiveBytes(params)
        flatten_params_inplace(params, _layout_of(params, 2), CPU, None, observer=probe)
        assert probe.peak == probe.param_bytes + probe.segment_bytes[0] >= 2 * probe.param_bytes

    def test_peak_stays_within_one_chunk(self) -> None:
        params = _params([(64,)] * 32)
        probe = _LiveBytes(params)
        flatten_params_inplace(params, _layout_of(params, 4), CPU, 128, observer=probe)
        assert len(probe.segment_bytes) == 16
        assert probe.peak <= probe.param_bytes + 128 * 4 + 4 * 2 * 4  # one chunk + at most the tail padding

    def test_custom_copy_fn_is_used_per_segment(self) -> None:
        calls: list[int] = []

        def counting_copy(tensors: list[torch.Tensor], out: torch.Tensor) -> None:
            calls.append(out.numel())
            torch_flatten_into(tensors, out)

        params = _params([(10,), (10,), (10,), (25,)])
        expected = [p.detach().clone() for p in params]
        buf = flatten_params_inplace(params, _layout_of(params, 2), CPU, 20, copy_fn=counting_copy)
        assert calls == [20, 10, 25] and len(buf.segments) == 3
        assert all(torch.equal(p, e) for p, e in zip(params, expected, strict=True))

    def test_no_host_copy_in_place_but_upstream_path_makes_them(self, monkeypatch: pytest.MonkeyPatch) -> None:
        host_calls: list[str] = []
        real_cpu, real_to = torch.Tensor.cpu, torch.Tensor.to

        def spy_cpu(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            host_calls.append("cpu")
            return real_cpu(self, *args, **kwargs)

        def spy_to(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            if any(str(a) == "cpu" for a in [*args, *kwargs.values()]):
                host_calls.append("to")
            return real_to(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "cpu", spy_cpu)
        monkeypatch.setattr(torch.Tensor, "to", spy_to)
        params = _params(SHAPES)
        probe = _LiveBytes(params)
        flatten_params(params, _layout_of(params), CPU, 16, FlattenPath.IN_PLACE, observer=probe)
        assert host_calls == [] and probe.count(FlattenStage.HOST_COPY) == 0

        params = _params(SHAPES)
        expected = [p.detach().clone() for p in params]
        probe = _LiveBytes(params)
        buf = flatten_params(params, _layout_of(params), CPU, 16, FlattenPath.VIA_HOST, observer=probe)
        assert host_calls.count("cpu") == len(SHAPES) and probe.count(FlattenStage.HOST_COPY) == len(SHAPES)
        assert buf.is_contiguous and all(torch.equal(p, e) for p, e in zip(params, expected, strict=True))

    def test_shared_storage_released_after_last_user(self) -> None:
        base = torch.randn(60)
        params = [
            torch.nn.Parameter(base[:30].view(5, 6)),
            torch.nn.Parameter(torch.randn(40)),
            torch.nn.Parameter(base[30:]),
        ]
        expected = [p.detach().clone() for p in params]
        storage = base.untyped_storage()
        del base
        probe = _LiveBytes(params)
        flatten_params_inplace(params, _layout_of(params, 2), CPU, 30, observer=probe)
        assert all(torch.equal(p, e) for p, e in zip(params, expected, strict=True))
        released = [e for e in probe.events if e.stage is FlattenStage.STORAGE_RELEASED]
        assert storage.nbytes() == 0
        assert [e.segment_index for e in released if e.nbytes == 240] == [2], "freed only after its last user"

    def test_partly_foreign_storage_is_retained(self) -> None:
        base = torch.arange(20, dtype=torch.float32)
        params = [torch.nn.Parameter(base[:10]), torch.nn.Parameter(torch.randn(7))]
        probe = _LiveBytes(params)
        flatten_params_inplace(params, _layout_of(params, 2), CPU, 8, observer=probe)
        assert probe.count(FlattenStage.STORAGE_RETAINED) == 1
        assert torch.equal(base, torch.arange(20, dtype=torch.float32)), "foreign data must not be touched"
        assert torch.equal(params[0].data, torch.arange(10, dtype=torch.float32))

    def test_strided_param(self) -> None:
        params = [torch.nn.Parameter(torch.randn(6, 4).t()), torch.nn.Parameter(torch.randn(3))]
        expected = [p.detach().clone() for p in params]
        flatten_params_inplace(params, _layout_of(params, 2), CPU, 4)
        assert all(torch.equal(p, e) and p.is_contiguous() for p, e in zip(params, expected, strict=True))

    def test_bf16_and_grad_flags_survive(self) -> None:
        params = _params(SHAPES, dtype=torch.bfloat16)
        params[2].requires_grad_(False)
        buf = flatten_params_inplace(params, _layout_of(params), CPU, 32)
        assert buf.dtype == torch.bfloat16
        assert [p.requires_grad for p in params] == [i != 2 for i in range(len(params))]

    def test_rejections(self) -> None:
        p = _params([(3,), (4,)])
        with pytest.raises(ValueError, match="twice"):
            flatten_params_inplace([p[0], p[0]], plan_group([(3,), (3,)], 2), CPU, 4)
        mixed = [p[0], torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))]
        with pytest.raises(ValueError, match="dtype"):
            flatten_params_inplace(mixed, _layout_of(mixed), CPU, 4)
        with pytest.raises(ValueError, match="slots"):
            flatten_params_inplace(p, plan_group([(3,)], 2), CPU, 4)
        with pytest.raises(ValueError, match="meta"):
            flatten_params_inplace([torch.empty(3, device="meta")], plan_group([(3,)], 2), CPU, 4)

    def test_upstream_path_matches_in_place(self) -> None:
        a, b = _params(SHAPES, seed=3), _params(SHAPES, seed=3)
        lean = flatten_params_inplace(a, _layout_of(a, 3), CPU, 16)
        upstream = flatten_params_via_host(b, _layout_of(b, 3), CPU)
        whole = Range(0, lean.layout.padded_numel)
        out = torch.empty(whole.size)
        lean.copy_out(whole, out)
        assert torch.equal(out, upstream.tensor)


def test_trim_cache_runs_after_each_segment_release() -> None:
    params = _params([(10,), (10,), (10,), (25,)])
    log: list[str] = []
    flatten_params_inplace(
        params,
        _layout_of(params, 2),
        CPU,
        20,
        observer=lambda e: log.append(e.stage.value),
        trim_cache=lambda: log.append("trim"),
    )
    assert log.count("trim") == 3
    for position, entry in enumerate(log):
        if entry == "trim":  # a trim follows the segment's releases and precedes the next allocation
            assert log[position - 1] == "storage_released"
            assert position + 1 == len(log) or log[position + 1] == "segment_allocated"


def test_master_partition_chunked_transfer_matches_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cross-device (CHUNKED) path moves the same values as DIRECT, in pieces, both ways."""
    from deepspeed._core.optim import master as optimizer_shard
    from deepspeed._core.optim.master import MasterPlacement, MasterShard, TransferPath

    monkeypatch.setattr(optimizer_shard, "TRANSFER_CHUNK_NUMEL", 7)  # several chunks, some across segments
    layout = plan_group(SHAPES, 2)
    values = torch.randn(layout.padded_numel).to(torch.bfloat16)
    bufs = []
    for path in (TransferPath.DIRECT, TransferPath.CHUNKED):
        buf = FlatBuffer.allocate(layout, CPU, torch.bfloat16, plan_segments(layout, 20))
        buf.copy_in(Range(0, layout.padded_numel), values)
        master = MasterShard.of_flat(buf, 1, torch.float32, MasterPlacement.DEVICE, path)
        assert master.writer.transfer is path
        assert torch.equal(master.param.data, values[layout.partition(1).as_slice()].float())
        master.param.data.add_(0.5)
        master.writer.write_partition(master.param.data)  # no all-gather: no process group here
        bufs.append(buf)
    out = [torch.empty(layout.partition(1).size, dtype=torch.bfloat16) for _ in bufs]
    for buf, o in zip(bufs, out, strict=True):
        buf.copy_out(layout.partition(1), o)
    assert torch.equal(out[0], out[1])
    assert torch.equal(out[1], (values[layout.partition(1).as_slice()].float() + 0.5).to(torch.bfloat16))


def test_send_through_host_converts_in_chunks_through_one_buffer() -> None:
    """Every piece arrives converted, at its offset, in at most ``chunk_numel`` elements, from one shared buffer."""
    from deepspeed._core.optim.master import send_through_host

    src = torch.randn(23)
    out = torch.full((23,), -1.0, dtype=torch.bfloat16)
    seen: list[tuple[int, int, int]] = []

    def write(start: int, piece: torch.Tensor) -> None:
        seen.append((start, piece.numel(), piece.untyped_storage().data_ptr()))
        out[start : start + piece.numel()].copy_(piece)

    send_through_host(src, torch.bfloat16, CPU, 7, write)
    assert [(s, n) for s, n, _ in seen] == [(0, 7), (7, 7), (14, 7), (21, 2)]
    assert len({ptr for _, _, ptr in seen}) == 1
    assert torch.equal(out, src.to(torch.bfloat16))


def test_send_through_host_into_many_shards_straddling_pieces() -> None:
    """ZeRO-3's write-back: one pipeline over a group's master, each piece split across the shards it overlaps."""
    from types import SimpleNamespace

    from deepspeed._core.optim.master import ScatterWriteBack, send_through_host

    sizes = [5, 1, 12, 3, 9]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    states = [
        SimpleNamespace(shard=torch.full((n,), -1.0, dtype=torch.bfloat16), layout=SimpleNamespace(partition_numel=n))
        for n in sizes
    ]
    master = torch.randn(sum(sizes))
    for chunk in (1, 4, 7, 30):
        writer = ScatterWriteBack(states, chunk)
        assert writer.offsets == offsets
        send_through_host(master, torch.bfloat16, CPU, chunk, writer.scatter)
        for state, off, n in zip(states, offsets, sizes, strict=True):
            assert torch.equal(state.shard, master[off : off + n].to(torch.bfloat16)), (chunk, off)
        for state in states:
            state.shard.fill_(-1.0)
