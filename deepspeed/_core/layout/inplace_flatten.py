"""Flatten a parameter group into a :class:`FlatBuffer` on the device, never through host memory.

The ``lean_inplace_flatten`` mechanism. The group is built segment by segment ([Note: layout], "In-place
flatten"): allocate one segment, copy its parameters in, point each ``param.data`` at its view, then resize
the parameters' old storages to zero bytes. At any moment the live bytes are the parameters' own bytes plus
at most one segment, the bound this module exists to keep.

:func:`flatten_params_via_host` keeps upstream's old behaviour (copy every parameter to the host, flatten
there, move the result back) for A/B comparisons only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deepspeed._core.layout.flat_buffer import FlatBuffer, storage_nbytes
from deepspeed._core.layout.shards import GroupLayout, Segment, SegmentPlan, plan_segments

FlattenCopy = Callable[[Sequence[torch.Tensor], torch.Tensor], None]
"""``copy_fn(tensors, out)``: write ``tensors`` back to back, flattened, into the 1-D ``out`` (same signature
as ``deepspeed.ops.flatten.flatten_into``). It must run on the current stream, or finish before returning:
the old storages are released right after it returns ([Note: layout], "Streams")."""


class FlattenStage(enum.Enum):
    """What a :class:`FlattenEvent` reports."""

    SEGMENT_ALLOCATED = "segment_allocated"
    """A segment's memory was just allocated: the moment of peak live bytes for that step."""
    SEGMENT_FILLED = "segment_filled"
    """A segment holds its parameters' values and the parameters now view it."""
    STORAGE_RELEASED = "storage_released"
    """A parameter's old storage was resized to zero bytes."""
    STORAGE_RETAINED = "storage_retained"
    """An old storage could not be resized (partly foreign or not resizable); only refcounting can free it."""
    HOST_COPY = "host_copy"
    """A device-to-host copy (only the upstream-behaviour path makes these)."""
    DEVICE_COPY = "device_copy"
    """A host-to-device copy of a whole flat buffer (upstream-behaviour path)."""


@dataclass(frozen=True)
class FlattenEvent:
    """One step of a flatten, for tests and memory instrumentation (``segment_index`` is -1 when n/a)."""

    stage: FlattenStage
    segment_index: int
    nbytes: int


FlattenObserver = Callable[[FlattenEvent], None]


class FlattenPath(enum.Enum):
    """Which flatten implementation to run (``LeanPolicy.inplace_flatten`` picks one)."""

    IN_PLACE = "in_place"
    VIA_HOST = "via_host"


def torch_flatten_into(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Default ``copy_fn``: one foreach copy into shaped views of ``out`` (no temporary for strided inputs)."""
    if sum(t.numel() for t in tensors) != out.numel():
        raise ValueError(f"tensors hold {sum(t.numel() for t in tensors)} elements, out has {out.numel()}")
    views = []
    start = 0
    for tensor in tensors:
        views.append(out[start : start + tensor.numel()].view(tensor.shape))
        start += tensor.numel()
    if views:
        with torch.no_grad():
            torch._foreach_copy_(views, list(tensors))


def _ignore(event: FlattenEvent) -> None:
    """Observer that records nothing."""


def _check_params(params: Sequence[torch.Tensor], layout: GroupLayout) -> torch.dtype:
    """Validate ``params`` against ``layout``; return their common dtype."""
    if len(params) != len(layout.slots):
        raise ValueError(f"layout has {len(layout.slots)} slots, got {len(params)} params")
    if len({id(p) for p in params}) != len(params):
        raise ValueError("params contains the same tensor twice; deduplicate tied parameters first")
    for slot, param in zip(layout.slots, params, strict=True):
        if tuple(param.shape) != slot.shape:
            raise ValueError(f"param {slot.index} has shape {tuple(param.shape)}, slot expects {slot.shape}")
        if param.device.type == "meta":
            raise ValueError(f"param {slot.index} is on the meta device and has no data to flatten")
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        raise ValueError(f"a flat group needs one dtype, params have {sorted(map(str, dtypes))}")
    return dtypes.pop() if dtypes else torch.float32


def _check_no_host_copy(params: Sequence[torch.Tensor], device: torch.device) -> None:
    """The in-place path never copies device memory to the host: reject an accelerator param bound for the CPU."""
    for index, param in enumerate(params):
        if device.type == "cpu" and param.device.type != "cpu":
            raise ValueError(
                f"param {index} is on {param.device}: flattening it onto the host is a device-to-host copy, "
                "which the in-place path never makes; pass the parameters' device or use flatten_params_via_host"
            )


_StorageKey = tuple[str, int]


def _storage_key(tensor: torch.Tensor) -> _StorageKey:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def _byte_extent(tensor: torch.Tensor) -> tuple[int, int]:
    start = int(tensor.storage_offset()) * tensor.element_size()
    return start, start + int(tensor.numel()) * tensor.element_size()


def _covers(extents: list[tuple[int, int]], nbytes: int) -> bool:
    """True when the union of byte intervals is exactly ``[0, nbytes)``."""
    reach = 0
    for start, end in sorted(extents):
        if start > reach:
            return False
        reach = max(reach, end)
    return reach == nbytes


@dataclass(frozen=True)
class _Release:
    """When an old storage can go, and whether it may be resized (only params of this group use it wholly)."""

    last_segment: int
    resizable: bool


def _plan_releases(params: Sequence[torch.Tensor], plan: SegmentPlan) -> dict[_StorageKey, _Release]:
    """For each old storage: the last segment whose params read it, and whether it is ours to resize."""
    extents: dict[_StorageKey, list[tuple[int, int]]] = {}
    last: dict[_StorageKey, int] = {}
    strided: set[_StorageKey] = set()
    nbytes: dict[_StorageKey, int] = {}
    for slot, param in zip(plan.layout.slots, params, strict=True):
        storage = param.untyped_storage()
        if storage.nbytes() == 0:
            continue
        key = _storage_key(param)
        extents.setdefault(key, []).append(_byte_extent(param))
        last[key] = plan.segment_of(slot).index
        nbytes[key] = storage.nbytes()
        if not param.is_contiguous():
            strided.add(key)
        if not storage.resizable():
            strided.add(key)
    return {key: _Release(last[key], key not in strided and _covers(extents[key], nbytes[key])) for key in extents}


def _release(storage: torch.UntypedStorage, release: _Release, segment: int, observe: FlattenObserver) -> None:
    nbytes = storage.nbytes()
    if release.resizable:
        storage.resize_(0)
        observe(FlattenEvent(FlattenStage.STORAGE_RELEASED, segment, nbytes))
    else:
        observe(FlattenEvent(FlattenStage.STORAGE_RETAINED, segment, nbytes))


def _fill_segment(
    params: Sequence[torch.Tensor], segment: Segment, tensor: torch.Tensor, layout: GroupLayout, copy_fn: FlattenCopy
) -> None:
    """Copy the segment's params into ``tensor`` and zero whatever tail padding it carries."""
    data_end = layout.slots[segment.slots.end - 1].range.end if segment.slots.size else segment.range.start
    data_numel = data_end - segment.range.start
    with torch.no_grad():
        tensor[data_numel:].zero_()
        copy_fn([p.data for p in params], tensor[:data_numel])


def flatten_params_inplace(
    params: Sequence[torch.Tensor],
    layout: GroupLayout,
    device: torch.device,
    chunk_numel: int | None,
    copy_fn: FlattenCopy | None = None,
    observer: FlattenObserver | None = None,
    trim_cache: Callable[[], None] | None = None,
) -> FlatBuffer:
    """Build ``layout``'s flat buffer on ``device`` in segments of about ``chunk_numel`` elements.

    ``params`` are in slot order. On return every ``param.data`` views the buffer and every old storage
    that belonged to these params alone has been resized to zero bytes. Peak live bytes: the params' bytes
    plus one segment, ``max(chunk_numel, largest param) + tail padding`` elements ([Note: layout]). ``None``
    for ``chunk_numel`` builds one segment (peak: twice the params).

    ``trim_cache`` (the ZeRO setup passes ``get_accelerator().empty_cache``) runs after each segment's old
    storages are released, so the next segment gets fresh memory instead of being carved out of a larger
    freed block, which would leave the block's remainder reserved for good ([Note: layout], "Reserved
    memory").
    """
    device = torch.device(device)
    dtype = _check_params(params, layout)
    _check_no_host_copy(params, device)
    copy_fn = copy_fn if copy_fn is not None else torch_flatten_into
    observe = observer if observer is not None else _ignore
    plan = plan_segments(layout, chunk_numel)
    releases = _plan_releases(params, plan)
    pending: dict[_StorageKey, torch.UntypedStorage] = {}
    segments = []
    for segment in plan.segments:
        members = params[segment.slots.as_slice()]
        tensor = torch.empty(segment.range.size, device=device, dtype=dtype)
        observe(FlattenEvent(FlattenStage.SEGMENT_ALLOCATED, segment.index, storage_nbytes(tensor)))
        for param in members:
            if param.untyped_storage().nbytes():
                pending.setdefault(_storage_key(param), param.untyped_storage())
        _fill_segment(members, segment, tensor, layout, copy_fn)
        for slot, param in zip(layout.slots[segment.slots.as_slice()], members, strict=True):
            local = slot.range.shift(-segment.range.start)
            param.data = tensor[local.as_slice()].view(slot.shape)
        segments.append(tensor)
        observe(FlattenEvent(FlattenStage.SEGMENT_FILLED, segment.index, storage_nbytes(tensor)))
        for key in [k for k in pending if releases[k].last_segment == segment.index]:
            _release(pending.pop(key), releases[key], segment.index, observe)
        if trim_cache is not None:
            trim_cache()
    return FlatBuffer(plan, segments)


def flatten_params_via_host(
    params: Sequence[torch.Tensor],
    layout: GroupLayout,
    device: torch.device,
    observer: FlattenObserver | None = None,
) -> FlatBuffer:
    """Upstream's old flatten, kept for A/B runs only: every param to the host, flatten there, move back.

    Costs a device-to-host copy of every parameter, host RAM for two copies of the group, and
    a doubled reservation on the device because the freed per-param blocks cannot hold the flat buffer.
    """
    device = torch.device(device)
    dtype = _check_params(params, layout)
    observe = observer if observer is not None else _ignore
    host = []
    for param in params:
        host.append(param.data.cpu())
        observe(FlattenEvent(FlattenStage.HOST_COPY, -1, param.numel() * param.element_size()))
        param.data = torch.empty(1, device=param.device, dtype=param.dtype)
    flat = torch.empty(layout.padded_numel, dtype=dtype)
    flat[layout.numel :].zero_()
    torch_flatten_into(host, flat[: layout.numel])
    del host
    moved = flat.to(device)
    observe(FlattenEvent(FlattenStage.DEVICE_COPY, -1, storage_nbytes(moved)))
    buffer = FlatBuffer.wrap(layout, moved)
    for slot, param in zip(layout.slots, params, strict=True):  # the params hold placeholders now, not their shapes
        param.data = buffer.view(slot)
    return buffer


def flatten_params(
    params: Sequence[torch.Tensor],
    layout: GroupLayout,
    device: torch.device,
    chunk_numel: int | None,
    path: FlattenPath,
    copy_fn: FlattenCopy | None = None,
    observer: FlattenObserver | None = None,
    trim_cache: Callable[[], None] | None = None,
) -> FlatBuffer:
    """Dispatch to :func:`flatten_params_inplace` or :func:`flatten_params_via_host` by ``path``."""
    if path is FlattenPath.VIA_HOST:
        return flatten_params_via_host(params, layout, device, observer)
    return flatten_params_inplace(params, layout, device, chunk_numel, copy_fn, observer, trim_cache)
