"""Replaying an allocator trace into block lifetimes, and the category of each block.

Input: the dict of ``torch.cuda.memory._snapshot()`` taken while ``_record_memory_history(enabled="all",
context="all", stacks="python")`` was on, or the pickle of it. ``device_traces[d]`` lists the allocator's actions
on device ``d`` in order (``alloc``, ``free_requested``, ``free_completed``, ``segment_*``, ``snapshot``, ``oom``),
each with ``addr``, ``size``, ``frames`` (innermost first) and, on recent torch, ``time_us``. ``segments`` holds the
blocks alive when the snapshot was taken (``address``, ``size``, ``requested_size``, ``state``, ``frames``).

Live bytes
    A block counts from its ``alloc`` to its ``free_completed``. A block whose free was requested but not yet
    completed still counts: that is the deferred-free memory of a design that marks blocks as used by a side
    stream (their free waits for that stream's work). Sizes are the sizes the trace reports (requested bytes), so
    the peak can sit slightly below ``max_memory_allocated`` (rounded blocks).

Blocks from before the recording
    A block alive when recording started has no ``alloc`` entry. It is counted from time 0 when it shows up either
    in ``segments`` (still alive at the end) or as a free of an address the trace never allocated. Its stack was not
    recorded, so it is classified by, in order: the engine's ``category_hints`` (tensor addresses of parameters,
    gradients, optimizer state and module buffers, stored in the snapshot when it was recorded, see
    :func:`~.hints.tensor_hints`), its frames if any, its free stack (:data:`~.rules.FREE_RULES`), else the extra
    band ``"before recording"`` (typically library workspaces, e.g. cuBLAS's, created in an earlier step).

Classification (:func:`classify`) of a block allocated during the recording
    1. Its allocation stack, innermost frame first: the first frame that matches a deciding rule of
       :data:`~.rules.ALLOC_RULES` decides (within one frame, the first matching rule in table order).
    2. Else the first frame matching :data:`~.rules.HELPER_RULES` (generic helpers whose category only holds when no
       caller decided, e.g. ``flat_buffer.alloc_storage`` also backs gathered parameters).
    3. Else its free stack, innermost frame first, against :data:`~.rules.FREE_RULES`: gradient reduction or
       ``zero_grad`` means ``gradients`` -- that is how autograd-produced ``.grad`` tensors, allocated on
       autograd's device thread with an empty Python stack, are told from backward temporaries; a parameter
       release path means ``gathered parameters``.
    4. Else ``activations`` when the stack is empty (autograd's device thread) or goes through autograd
       (:data:`~.rules.BACKWARD_RULES`); else ``buffers``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from .rules import (
    ACTS,
    ALLOC_RULES,
    BACKWARD_RULES,
    BEFORE_RECORDING,
    BUFFERS,
    CATEGORIES,
    FREE_RULES,
    HELPER_RULES,
    Rule,
)

_Frames = Sequence[Mapping[str, Any]]


def _normalise(filename: str) -> str:
    return filename.replace("\\", "/")


# Per rule table: the table itself (kept referenced, so a replaced table never shares an id with a cached one) and
# the category found for each (filename, function) pair; stacks repeat, so this makes classification cheap.
_CACHES: dict[int, tuple[Sequence[Rule], dict[tuple[str, str], str | None]]] = {}


def _first_match(rules: Sequence[Rule], frame: Mapping[str, Any]) -> str | None:
    entry = _CACHES.get(id(rules))
    if entry is None or entry[0] is not rules:
        entry = _CACHES[id(rules)] = (rules, {})
    cache = entry[1]
    key = (str(frame.get("filename", "")), str(frame.get("name", "")))
    if key not in cache:
        filename = _normalise(key[0])
        cache[key] = next((r.category for r in rules if r.matches(filename, key[1])), None)
    return cache[key]


def _scan(rules: Sequence[Rule], frames: _Frames) -> str | None:
    for frame in frames:
        found = _first_match(rules, frame)
        if found is not None:
            return found
    return None


def _python_frames(frames: _Frames | None) -> list[Mapping[str, Any]]:
    # stacks="all" adds C++ frames; only Python frames carry the file names the rules look at.
    return [f for f in frames or () if str(f.get("filename", "")).endswith(".py")]


def _by_alloc_stack(alloc_frames: _Frames) -> str | None:
    return _scan(ALLOC_RULES, alloc_frames) or _scan(HELPER_RULES, alloc_frames)


def classify(alloc_frames: _Frames | None, free_frames: _Frames | None = None) -> str:
    """Category (one of :data:`CATEGORIES`) of a block allocated at ``alloc_frames`` and freed at ``free_frames``.

    Frames are innermost first, as the snapshot stores them; ``free_frames`` is empty for a block never freed.
    See the module docstring for the rules.
    """
    alloc = _python_frames(alloc_frames)
    found = _by_alloc_stack(alloc) or _scan(FREE_RULES, _python_frames(free_frames))
    if found is not None:
        return found
    if not alloc or _scan(BACKWARD_RULES, alloc) is not None:
        return ACTS
    return BUFFERS


# ----------------------------------------------------------------------------------------------------------------
# replaying the trace


class _Block:
    """One allocation's lifetime in the trace (mutable while the trace is replayed)."""

    __slots__ = (
        "addr",
        "alloc_frames",
        "alloc_index",
        "category",
        "free_completed",
        "free_frames",
        "free_requested",
        "size",
    )

    def __init__(self, addr: int, size: int, alloc_frames: _Frames, alloc_index: int) -> None:
        self.addr, self.size, self.alloc_frames = addr, size, alloc_frames
        self.alloc_index = alloc_index  # trace index of the alloc; -1: alive before recording started
        self.free_frames: _Frames = ()
        self.free_requested: int | None = None
        self.free_completed: int | None = None
        self.category = BUFFERS


class Analysis(NamedTuple):
    """Every block of one device's trace, classified, with the trace's timestamps and anomalies."""

    trace: list[dict]
    blocks: list[_Block]
    times: list[float] | None  # time_us of every entry, or None when the trace has no timestamps
    anomalies: dict[str, int]
    phases: list[tuple[str, float]]


def _device_trace(snapshot: Mapping[str, Any], device: int) -> list[dict]:
    traces = snapshot.get("device_traces") or []
    return list(traces[device]) if 0 <= device < len(traces) else []


def _replay(trace: list[dict], anomalies: dict[str, int]) -> tuple[list[_Block], dict[int, _Block]]:
    blocks: list[_Block] = []
    live: dict[int, _Block] = {}
    for i, entry in enumerate(trace):
        action = entry.get("action")
        if action == "alloc":
            addr: int = entry["addr"]  # alloc and free entries carry their block's address; an oom entry has none
            if addr in live:  # the free of the previous block at this address is missing from the trace
                anomalies["alloc_of_live_address"] = anomalies.get("alloc_of_live_address", 0) + 1
                live.pop(addr).free_completed = i
            block = _Block(addr, int(entry.get("size", 0)), entry.get("frames") or (), i)
            blocks.append(block)
            live[addr] = block
        elif action in ("free_requested", "free_completed"):
            addr = entry["addr"]
            if addr not in live:  # allocated before recording started (or dropped by the ring buffer)
                live[addr] = _Block(addr, int(entry.get("size", 0)), (), -1)
                blocks.append(live[addr])
                if action == "free_completed":
                    anomalies["free_completed_without_request"] = anomalies.get("free_completed_without_request", 0) + 1
            block = live[addr]
            if action == "free_requested":
                block.free_requested, block.free_frames = i, entry.get("frames") or ()
            else:
                block.free_completed = i
                del live[addr]
        elif action == "oom":
            anomalies["oom"] = anomalies.get("oom", 0) + 1
    return blocks, live


def _segment_blocks(snapshot: Mapping[str, Any], device: int) -> Iterable[tuple[int, int, _Frames]]:
    """(address, bytes, frames) of every allocated block in ``segments`` on ``device``."""
    for seg in snapshot.get("segments") or ():
        if seg.get("device", device) != device:
            continue
        offset = int(seg.get("address", 0))
        for blk in seg.get("blocks") or ():
            size = int(blk.get("size", 0))
            addr = int(blk.get("address", offset))
            offset = addr + size
            if blk.get("state") in ("active_allocated", "active_awaiting_free"):
                yield addr, int(blk.get("requested_size", size)), blk.get("frames") or ()


def _hint_index(snapshot: Mapping[str, Any]) -> tuple[list[int], list[tuple[int, str]]]:
    hints = sorted(
        (int(h["address"]), int(h.get("size", 0)), str(h["category"]))
        for h in snapshot.get("category_hints") or ()
        if h.get("category") in CATEGORIES
    )
    return [h[0] for h in hints], [(h[1], h[2]) for h in hints]


def _hinted_category(block: _Block, index: tuple[list[int], list[tuple[int, str]]]) -> str | None:
    starts, payload = index
    lo = bisect.bisect_left(starts, block.addr)
    hi = bisect.bisect_left(starts, block.addr + max(block.size, 1))
    votes: dict[str, int] = {}
    for size, category in payload[lo:hi]:
        votes[category] = votes.get(category, 0) + max(size, 1)
    return max(votes, key=votes.__getitem__) if votes else None


def _classify_baseline(block: _Block, hints: tuple[list[int], list[tuple[int, str]]]) -> str:
    found = (
        _hinted_category(block, hints)
        or _by_alloc_stack(_python_frames(block.alloc_frames))
        or _scan(FREE_RULES, _python_frames(block.free_frames))
    )
    return found if found is not None else BEFORE_RECORDING


def analyse(snapshot: Mapping[str, Any], device: int) -> Analysis:
    """Replay ``snapshot``'s trace on ``device`` and classify every block it saw."""
    trace = _device_trace(snapshot, device)
    anomalies: dict[str, int] = {}
    blocks, live_at_end = _replay(trace, anomalies)
    for addr, size, frames in _segment_blocks(snapshot, device):
        if addr not in live_at_end:  # alive through the whole recording
            blocks.append(_Block(addr, size, frames, -1))
    hints = _hint_index(snapshot)
    for block in blocks:
        if block.alloc_index < 0:
            block.category = _classify_baseline(block, hints)
        else:
            block.category = classify(block.alloc_frames, block.free_frames)
    has_time = bool(trace) and all("time_us" in e for e in trace)
    times = [float(e["time_us"]) for e in trace] if has_time else None
    phases = [(str(p.get("name", "")), float(p.get("time_us", 0))) for p in recording_meta(snapshot).get("phases", ())]
    return Analysis(trace, blocks, times, anomalies, phases)


def recording_meta(snapshot: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``recording`` entry the engine stores in a snapshot (step, rank, device, phases), or ``{}``."""
    meta = snapshot.get("recording")
    return meta if isinstance(meta, Mapping) else {}
