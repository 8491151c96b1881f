"""Per-step device-memory timeline by category, from a PyTorch CUDA allocator snapshot (config ``memory_timeline``).

Input: the dict of ``torch.cuda.memory._snapshot()`` taken while ``_record_memory_history(enabled="all",
context="all", stacks="python")`` was on, or the pickle of it. ``device_traces[d]`` lists the allocator's actions
on device ``d`` in order (``alloc``, ``free_requested``, ``free_completed``, ``segment_*``, ``snapshot``, ``oom``),
each with ``addr``, ``size``, ``frames`` (innermost first) and, on recent torch, ``time_us``. ``segments`` holds the
blocks alive when the snapshot was taken (``address``, ``size``, ``requested_size``, ``state``, ``frames``).

This module is pure: standard library only (matplotlib is imported inside :func:`plot_timeline`), so benchmark
workers running any DeepSpeed -- or none -- can load it by file path (``importlib.util.spec_from_file_location``;
registering it in ``sys.modules`` is not required: its records are ``NamedTuple`` classes, not dataclasses, whose
string annotations would need that entry).

Live bytes
    A block counts from its ``alloc`` to its ``free_completed``. A block whose free was requested but not yet
    completed still counts: that is the deferred-free memory of a design that marks blocks as used by a side
    stream (their free waits for that stream's work). Sizes are the sizes the
    trace reports (requested bytes), so the peak can sit slightly below ``max_memory_allocated`` (rounded blocks).

Blocks from before the recording
    A block alive when recording started has no ``alloc`` entry. It is counted from time 0 when it shows up either
    in ``segments`` (still alive at the end) or as a free of an address the trace never allocated. Its stack was not
    recorded, so it is classified by, in order: the engine's ``category_hints`` (tensor addresses of parameters,
    gradients, optimizer state and module buffers, stored in the snapshot by the engine), its frames if any, its
    free stack (:data:`FREE_RULES`), else the extra band ``"before recording"`` (typically library workspaces,
    e.g. cuBLAS's, created in an earlier step).

Classification (:func:`classify`) of a block allocated during the recording
    1. Its allocation stack, innermost frame first: the first frame that matches a rule of :data:`ALLOC_RULES`
       decides (within one frame, the first matching rule in table order).
    2. Else the first frame matching :data:`HELPER_RULES` (generic helpers whose category only holds when no
       caller decided, e.g. ``flat_buffer.alloc_storage`` also backs gathered parameters).
    3. Else its free stack, innermost frame first, against :data:`FREE_RULES`: gradient reduction or
       ``zero_grad`` means ``gradients`` -- that is how autograd-produced ``.grad`` tensors, allocated on
       autograd's device thread with an empty Python stack, are told from backward temporaries; a parameter
       release path means ``gathered parameters``.
    4. Else ``activations`` when the stack is empty (autograd's device thread) or goes through autograd
       (:data:`BACKWARD_RULES`); else ``buffers``.

================== ========================================================================================
category           allocation stack contains (ours = deepspeed/_core, upstream = deepspeed/runtime, FSDP2 =
                   torch/distributed/fsdp/_fully_shard)
================== ========================================================================================
gathered           ours: zero/param_group.py gathers, zero/collectives.py all-gathers, zero/gathered.py,
                   zero/manager.py fetch/prefetch/pre_forward/pre_backward; upstream: partition_parameters.py
                   ``*all_gather*``/``*allgather*``, partitioned_param_coordinator.py fetch; FSDP2:
                   _fsdp_collectives.py ``foreach_all_gather*``, _fsdp_param.py unsharded/all-gather outputs,
                   _fsdp_param_group.py unshard/prefetch; plus release paths of rule 3
gradients          ours: zero/grad_reduce.py, zero/stage3.py ``_on_grad``/``_launch_bucket``/``_finish``/
                   ``flush``/accumulators, zero/stage12.py backward hooks, engine/grad_sync.py; upstream:
                   stage3.py/stage_1_and_2.py reduce/ipg/grad functions, engine.py allreduce; FSDP2:
                   ``foreach_reduce*``, post_backward, grad accumulation; plus rule 3 above
optimizer state    ours: zero/optimizer_shard.py, zero/chunked_step.py, zero/step_common.py, _core/optim,
                   stage3/stage12 ``_build_group``/``step``; torch/optim; deepspeed/ops; upstream step and
                   optimizer-state set-up functions; the engines' ``step``
parameters         ours: zero/init_context.py, zero/inplace_flatten.py, zero/param_group.py ``partition``,
                   engine/setup.py; upstream: fp16/bit16 flat buffers; FSDP2: fully_shard;
                   ``nn.Module.to/_apply``; helpers (rule 2): zero/flat_buffer.py, zero/param.py,
                   zero/offload_param.py, upstream partition_parameters.py, FSDP2 _fsdp_param.py
activations        torch/utils/checkpoint.py (recompute), activation-checkpointing modules, ``nn.Module``
                   calls, the engines' ``forward``; rule 4 above
buffers            everything else (inputs, communication staging, module buffers, workspaces);
                   module buffers alive before recording are hinted as buffers
================== ========================================================================================

To extend the rules, add a :class:`Rule` (category, filename substring, optional function-name glob patterns) to
the right table; order matters only between rules that can match the same frame.
"""
from __future__ import annotations

import argparse
import bisect
import fnmatch
import json
import pickle
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

CATEGORIES = ("parameters", "gathered parameters", "gradients", "optimizer state", "activations", "buffers")
BEFORE_RECORDING = "before recording"
"""Extra band: blocks alive when recording started that no hint, frame or free stack could place."""
PLOT_CATEGORIES = CATEGORIES + (BEFORE_RECORDING,)
_STACK_ORDER = (BEFORE_RECORDING, "parameters", "optimizer state", "gradients", "gathered parameters", "activations",
                "buffers")  # chart bottom to top: long-lived state first, transients on top

PARAMS, GATHERED, GRADS, OPTIM, ACTS, BUFFERS = CATEGORIES
_COLORS = dict(zip(PLOT_CATEGORIES, ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#d62728", "#8c564b", "#7f7f7f")))
_Frames = Sequence[Mapping[str, Any]]


class Rule(NamedTuple):
    """One classification rule: a frame matches when ``path`` is a substring of its filename (``/``-separated)
    and, if ``names`` is not empty, its function name matches one of the glob patterns."""

    category: str
    path: str
    names: tuple[str, ...] = ()

    def matches(self, filename: str, name: str) -> bool:
        """True when a frame with this ``filename`` and function ``name`` matches the rule."""
        if self.path not in filename:
            return False
        return not self.names or any(fnmatch.fnmatchcase(name, pattern) for pattern in self.names)


_Z = "deepspeed/_core/"
_E = "deepspeed/_core/engine/"
_UP = "deepspeed/runtime/"
_FSDP = "torch/distributed/fsdp/_fully_shard/"
_UP_GRAD_NAMES = ("*reduce*", "*ipg*", "*_grads*", "*gradient*", "*grad_to*", "average_tensor", "*allreduce*",
                  "partition_grads", "_setup_for_real_optimizer", "*accumulate*")

ALLOC_RULES: tuple[Rule, ...] = (
    # gathered parameters
    Rule(GATHERED, _Z + "params/gather.py", ("start_gather", "finish_gather", "_copy_out", "gather", "unshard",
                                           "wait_for_unshard", "acquire")),
    Rule(GATHERED, _Z + "comm/collectives.py", ("start_all_gather", "finish_all_gather")),
    Rule(GATHERED, _Z + "params/gathered.py"),
    Rule(GATHERED, _Z + "params/manager.py", ("fetch", "_prefetch", "pre_forward", "pre_backward", "on_param_access")),
    Rule(GATHERED, _UP + "zero/partition_parameters.py", ("*all_gather*", "*allgather*", "wait",
                                                          "_ensure_availability_of_partitioned_params")),
    Rule(GATHERED, _UP + "zero/partitioned_param_coordinator.py", ("*fetch*", "*all_gather*")),
    Rule(GATHERED, _FSDP + "_fsdp_collectives.py", ("foreach_all_gather*", "all_gather_copy_in*",
                                                    "_get_param_all_gather_inputs")),
    Rule(GATHERED, _FSDP + "_fsdp_param.py", ("*all_gather*", "alloc_storage", "init_unsharded_param", "to_unsharded",
                                              "unsharded_param", "to_sharded_post_forward*")),
    Rule(GATHERED, _FSDP + "_fsdp_param_group.py", ("*unshard*", "_backward_prefetch", "_to_sharded_post_forward")),
    # gradients
    Rule(GRADS, _Z + "grads/reducer.py"),
    Rule(GRADS, _Z + "grads/accumulator.py"),
    Rule(GRADS, _Z + "optim/stage3.py", ("_on_grad", "_launch_bucket", "_finish", "flush", "finish_backward",
                                   "ensure_accumulator", "_setup_grads")),
    Rule(GRADS, _Z + "optim/stage12.py", ("prepare_backward", "finish_backward", "_grad_partition")),
    Rule(GRADS, _Z + "comm/host_transfer.py"),
    Rule(GRADS, _Z + "grads/allreduce.py"),
    Rule(GRADS, _E + "data_parallel.py", ("prepare_backward", "finish_backward")),
    Rule(GRADS, _E + "precision.py", ("grads_to_masters",)),
    Rule(GRADS, _UP + "zero/stage3.py", _UP_GRAD_NAMES),
    Rule(GRADS, _UP + "zero/stage_1_and_2.py", _UP_GRAD_NAMES),
    Rule(GRADS, _UP + "engine.py", ("allreduce_*", "*_gradients", "buffered_allreduce_fallback", "sparse_allreduce*",
                                    "_get_gradients_for_reduction")),
    Rule(GRADS, _FSDP + "_fsdp_collectives.py", ("foreach_reduce*", "_div_if_needed")),
    Rule(GRADS, _FSDP + "_fsdp_param.py", ("*grad*",)),
    Rule(GRADS, _FSDP + "_fsdp_param_group.py", ("post_backward", "finalize_backward")),
    Rule(GRADS, _FSDP + "_fsdp_state.py", ("_root_post_backward_final_callback",)),
    # optimizer state
    Rule(OPTIM, _Z + "optim/master.py"),
    Rule(OPTIM, _Z + "optim/chunked_step.py"),
    Rule(OPTIM, _Z + "optim/sharded_step.py"),
    Rule(OPTIM, "deepspeed/_core/optim/"),
    Rule(OPTIM, _Z + "optim/stage3.py", ("_build_group", "step", "write_back", "refresh_fp32_params")),
    Rule(OPTIM, _Z + "optim/stage12.py", ("_build_group", "step", "_step_group", "publish_weights", "refresh_fp32_params")),
    Rule(OPTIM, _E + "data_parallel.py", ("__init__", "step")),
    Rule(OPTIM, _E + "precision.py", ("__init__", "masters_to_working")),
    Rule(OPTIM, "torch/optim/"),
    Rule(OPTIM, "deepspeed/ops/"),
    Rule(OPTIM, _UP + "zero/stage3.py", ("step", "_optimizer_step", "*fp32*", "initialize_optimizer_states",
                                         "_create_momentum_buffer")),
    Rule(OPTIM, _UP + "zero/stage_1_and_2.py", ("step", "_optimizer_step", "initialize_optimizer_states",
                                                "_lazy_init_hp_params_optimizer_state")),
    Rule(OPTIM, _UP + "bf16_optimizer.py"),
    Rule(OPTIM, _UP + "fp16/"),
    Rule(OPTIM, _UP + "engine.py", ("step", "_take_model_step")),
    Rule(OPTIM, _E + "training.py", ("step", "_take_model_step")),
    # parameters
    Rule(PARAMS, _Z + "params/init_context.py"),
    Rule(PARAMS, _Z + "layout/inplace_flatten.py"),
    Rule(PARAMS, _Z + "params/gather.py", ("partition", "commit")),
    Rule(PARAMS, _E + "setup.py"),
    Rule(PARAMS, _E + "precision.py", ("cast_module_params",)),
    Rule(PARAMS, _UP + "zero/stage3.py", ("*fp16*", "*flat*")),
    Rule(PARAMS, _UP + "zero/stage_1_and_2.py", ("*flat*", "*bit16*")),
    Rule(PARAMS, _FSDP + "_fully_shard.py"),
    Rule(PARAMS, _FSDP + "_fsdp_init.py"),
    Rule(PARAMS, "torch/nn/modules/module.py", ("_apply", "to", "cuda", "to_empty", "*load_state_dict*")),
    # activations
    Rule(ACTS, "torch/utils/checkpoint.py"),
    Rule(ACTS, _E + "activation_checkpoint.py"),
    Rule(ACTS, _UP + "activation_checkpointing/"),
    Rule(ACTS, _FSDP + "_fsdp_state.py", ("_cast_forward_inputs", "_cast_output_dtype", "*pre_forward*")),
    Rule(ACTS, "torch/nn/modules/module.py", ("_call_impl", "_wrapped_call_impl")),
    Rule(ACTS, _E + "training.py", ("forward",)),
    Rule(ACTS, _UP + "engine.py", ("forward",)),
)
"""Decisive rules, checked on the allocation stack innermost frame first."""

HELPER_RULES: tuple[Rule, ...] = (
    Rule(PARAMS, _Z + "layout/flat_buffer.py"),
    Rule(PARAMS, _Z + "params/param.py"),
    Rule(PARAMS, _Z + "params/placement.py"),
    Rule(PARAMS, _UP + "zero/partition_parameters.py"),
    Rule(PARAMS, _FSDP + "_fsdp_param.py"),
)
"""Generic helpers: their category applies only when no frame matched :data:`ALLOC_RULES`."""

FREE_RULES: tuple[Rule, ...] = (
    # gradient reduction and zero_grad: autograd-produced .grad tensors
    Rule(GRADS, _Z + "grads/reducer.py"),
    Rule(GRADS, _Z + "grads/accumulator.py"),
    Rule(GRADS, _Z + "optim/stage3.py", ("_on_grad", "_launch_bucket", "_finish", "flush", "_clear_grads")),
    Rule(GRADS, _Z + "optim/stage12.py", ("finish_backward", "_clear_grads", "_grad_partition", "step")),
    Rule(GRADS, _Z + "grads/allreduce.py"),
    Rule(GRADS, _E + "data_parallel.py", ("finish_backward", "step")),
    Rule(GRADS, _E + "precision.py", ("grads_to_masters", "drop_master_grads")),
    Rule(GRADS, _UP + "zero/stage3.py", _UP_GRAD_NAMES),
    Rule(GRADS, _UP + "zero/stage_1_and_2.py", _UP_GRAD_NAMES),
    Rule(GRADS, _UP + "engine.py", ("allreduce_*", "*_gradients")),
    Rule(GRADS, _FSDP + "_fsdp_collectives.py", ("foreach_reduce*",)),
    Rule(GRADS, _FSDP + "_fsdp_param.py", ("*grad*",)),
    Rule(GRADS, _FSDP + "_fsdp_param_group.py", ("post_backward", "finalize_backward")),
    Rule(GRADS, "", ("zero_grad",)),
    # parameter release: gathered storage (matters for blocks gathered before recording started)
    Rule(GATHERED, _Z + "params/gather.py", ("free", "release", "_retire_flat", "drain", "shutdown", "<lambda>")),
    Rule(GATHERED, _Z + "params/manager.py", ("release*", "_sweep_kept", "post_forward", "post_backward")),
    Rule(GATHERED, _UP + "zero/partitioned_param_coordinator.py", ("*release*",)),
    Rule(GATHERED, _UP + "zero/partition_parameters.py", ("free_param", "*partition*")),
    Rule(GATHERED, _FSDP + "_fsdp_param.py", ("free_unsharded_param", "to_sharded*")),
    Rule(GATHERED, _FSDP + "_fsdp_param_group.py", ("reshard", "post_forward", "_to_sharded*")),
)
"""Free-stack rules, innermost frame first: a generic allocation freed on a gradient path was a gradient, one
freed on a parameter-release path was gathered storage."""

BACKWARD_RULES: tuple[Rule, ...] = (
    Rule(ACTS, "torch/autograd/"),
    Rule(ACTS, "torch/_tensor.py", ("backward",)),
    Rule(ACTS, _E + "training.py", ("backward",)),
    Rule(ACTS, _UP + "engine.py", ("backward",)),
)
"""Stacks that make an otherwise unexplained allocation a backward temporary (``activations``)."""


# ----------------------------------------------------------------------------------------------------------------
# classification


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

    __slots__ = ("addr", "alloc_frames", "alloc_index", "category", "free_completed", "free_frames", "free_requested",
                 "size")

    def __init__(self, addr: int, size: int, alloc_frames: _Frames, alloc_index: int) -> None:
        self.addr, self.size, self.alloc_frames = addr, size, alloc_frames
        self.alloc_index = alloc_index  # trace index of the alloc; -1: alive before recording started
        self.free_frames: _Frames = ()
        self.free_requested: int | None = None
        self.free_completed: int | None = None
        self.category = BUFFERS


class _Analysis(NamedTuple):
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
        action, addr = entry.get("action"), entry.get("addr")
        if action == "alloc":
            if addr in live:  # the free of the previous block at this address is missing from the trace
                anomalies["alloc_of_live_address"] = anomalies.get("alloc_of_live_address", 0) + 1
                live.pop(addr).free_completed = i
            block = _Block(addr, int(entry.get("size", 0)), entry.get("frames") or (), i)
            blocks.append(block)
            live[addr] = block
        elif action in ("free_requested", "free_completed"):
            block = live.get(addr)
            if block is None:  # allocated before recording started (or dropped by the ring buffer)
                block = _Block(addr, int(entry.get("size", 0)), (), -1)
                blocks.append(block)
                live[addr] = block
                if action == "free_completed":
                    anomalies["free_completed_without_request"] = anomalies.get("free_completed_without_request", 0) + 1
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
    hints = sorted((int(h["address"]), int(h.get("size", 0)), str(h["category"]))
                   for h in snapshot.get("category_hints") or () if h.get("category") in CATEGORIES)
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
    found = (_hinted_category(block, hints) or _by_alloc_stack(_python_frames(block.alloc_frames))
             or _scan(FREE_RULES, _python_frames(block.free_frames)))
    return found if found is not None else BEFORE_RECORDING


def _analyse(snapshot: Mapping[str, Any], device: int) -> _Analysis:
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
    phases = [(str(p.get("name", "")), float(p.get("time_us", 0))) for p in _recording(snapshot).get("phases", ())]
    return _Analysis(trace, blocks, times, anomalies, phases)


def _recording(snapshot: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = snapshot.get("recording")
    return meta if isinstance(meta, Mapping) else {}


# ----------------------------------------------------------------------------------------------------------------
# timeline


class Timeline(NamedTuple):
    """Live bytes per category after each allocation-changing event of one device's trace (a small record).

    Attributes:
        times: x of each point: microseconds since the first trace entry, or the entry index when the trace has
            no timestamps (see ``time_unit``). Point 0 is the state when recording started.
        time_unit: ``"us"`` or ``"entry"``.
        entry_index: trace index of each point (-1 for point 0).
        live: category -> live bytes at each point, for every name of :data:`PLOT_CATEGORIES`.
        total: live bytes over all categories at each point.
        peak_index: index (into the point arrays) of the first point where ``total`` is largest.
        phases: ``(name, x)`` marks the engine recorded (e.g. ``"after forward"``), in the units of ``times``.
    """

    times: array
    time_unit: str
    entry_index: array
    live: dict[str, array]
    total: array
    peak_index: int
    phases: list[tuple[str, float]]

    def at(self, index: int) -> dict[str, int]:
        """Live bytes per category at point ``index``."""
        return {c: int(v[index]) for c, v in self.live.items()}


def _deltas(analysis: _Analysis) -> tuple[dict[str, int], dict[int, list[tuple[str, int]]]]:
    start = {c: 0 for c in PLOT_CATEGORIES}
    changes: dict[int, list[tuple[str, int]]] = {}
    for block in analysis.blocks:
        if block.alloc_index < 0:
            start[block.category] += block.size
        else:
            changes.setdefault(block.alloc_index, []).append((block.category, block.size))
        if block.free_completed is not None:
            changes.setdefault(block.free_completed, []).append((block.category, -block.size))
    return start, changes


def _timeline_from(analysis: _Analysis) -> Timeline:
    start, changes = _deltas(analysis)
    t0 = analysis.times[0] if analysis.times else 0.0

    def x_of(i: int) -> float:
        return analysis.times[i] - t0 if analysis.times else float(i)

    live = {c: array("q", [start[c]]) for c in PLOT_CATEGORIES}
    current = dict(start)
    times, index, total = array("d", [0.0]), array("q", [-1]), array("q", [sum(start.values())])
    for i in sorted(changes):
        for category, delta in changes[i]:
            current[category] += delta
        for c in PLOT_CATEGORIES:
            live[c].append(current[c])
        times.append(x_of(i))
        index.append(i)
        total.append(sum(current.values()))
    peak = max(range(len(total)), key=total.__getitem__)
    # Phase marks carry wall-clock microseconds, like time_us; without timestamps they cannot be placed.
    phases = [(name, t - t0) for name, t in analysis.phases] if analysis.times else []
    return Timeline(times, "us" if analysis.times else "entry", index, live, total, peak, phases)


def build_timeline(snapshot: Mapping[str, Any], device: int = 0) -> Timeline:
    """Replay ``snapshot``'s trace on ``device`` into a :class:`Timeline` of live bytes per category."""
    return _timeline_from(_analyse(snapshot, device))


# ----------------------------------------------------------------------------------------------------------------
# deferred frees and summary


def _deferred_from(analysis: _Analysis) -> dict[str, Any]:
    # A free is deferred when the program went on (another alloc or free request) between the request and the
    # completion, or when it is still pending at the end. Timestamps alone cannot tell: adjacent entries can
    # differ by a microsecond.
    progress = array("q", [0])
    for entry in analysis.trace:
        progress.append(progress[-1] + (entry.get("action") in ("alloc", "free_requested")))
    out = {"count": 0, "bytes": 0, "max_delay_entries": 0, "max_delay_us": None, "pending_at_end": 0,
           "gathered_count": 0, "gathered_bytes": 0}
    for block in analysis.blocks:
        req, done = block.free_requested, block.free_completed
        if req is None:
            continue
        if done is not None and progress[done] - progress[req + 1] <= 0:
            continue
        out["count"] += 1
        out["bytes"] += block.size
        out["pending_at_end"] += done is None
        end = done if done is not None else len(analysis.trace) - 1
        out["max_delay_entries"] = max(out["max_delay_entries"], end - req)
        if analysis.times is not None:
            delay = analysis.times[end] - analysis.times[req]
            out["max_delay_us"] = max(out["max_delay_us"] or 0.0, delay)
        if block.category == GATHERED:
            out["gathered_count"] += 1
            out["gathered_bytes"] += block.size
    return out


def deferred_frees(snapshot: Mapping[str, Any], device: int = 0) -> dict[str, Any]:
    """Frees whose completion was deferred past later allocator activity (blocks marked as used by another stream).

    Returns ``count``, ``bytes``, ``max_delay_entries``, ``max_delay_us`` (None without timestamps),
    ``pending_at_end`` (requested but not completed when the snapshot was taken) and ``gathered_count`` /
    ``gathered_bytes`` (those among ``gathered parameters`` blocks). A stream-ordered design has none.
    """
    return _deferred_from(_analyse(snapshot, device))


def _phase_before(timeline: Timeline, x: float) -> str | None:
    before = [name for name, t in timeline.phases if t <= x]
    return before[-1] if before else None


def _warnings(analysis: _Analysis, max_entries: int | None) -> list[str]:
    notes = []
    if max_entries is not None and len(analysis.trace) >= max_entries:
        notes.append(f"the trace holds max_entries={max_entries} entries: the allocator's ring buffer probably "
                     "dropped the oldest ones; raise memory_timeline.max_entries")
    if analysis.anomalies.get("free_completed_without_request") or analysis.anomalies.get("alloc_of_live_address"):
        notes.append(f"inconsistent trace (entries missing): {analysis.anomalies}")
    if analysis.anomalies.get("oom"):
        notes.append(f"the allocator reported {analysis.anomalies['oom']} out-of-memory error(s) in the window")
    if not analysis.trace:
        notes.append("empty trace: was _record_memory_history(enabled='all') on for this device?")
    return notes


def summarize(snapshot: Mapping[str, Any], device: int = 0, unit_bytes: float | None = None) -> dict[str, Any]:
    """JSON-serialisable summary of the recorded window on ``device``.

    ``unit_bytes`` (bytes of one gathered layer) adds ``gathered_layers_alive_max_from_trace``: the most
    ``gathered parameters`` bytes alive at once divided by it.
    """
    analysis = _analyse(snapshot, device)
    tl = _timeline_from(analysis)
    peak = tl.peak_index
    gathered_max = max(tl.live[GATHERED]) if len(tl.total) else 0
    early = [b for b in analysis.blocks if b.alloc_index < 0 and b.free_requested is not None]
    return {
        "device": device,
        "events": len(analysis.trace),
        "time_unit": tl.time_unit,
        "duration": tl.times[-1],
        "peak_allocated_bytes": int(tl.total[peak]),
        "peak_time": tl.times[peak],
        "peak_entry_index": int(tl.entry_index[peak]),
        "peak_after_phase": _phase_before(tl, tl.times[peak]),
        "peak_by_category": tl.at(peak),
        "max_by_category": {c: int(max(v)) for c, v in tl.live.items()},
        "start_by_category": tl.at(0),
        "end_by_category": tl.at(len(tl.total) - 1),
        "gathered_max_bytes": int(gathered_max),
        "unit_bytes": unit_bytes,
        "gathered_layers_alive_max_from_trace": (gathered_max / unit_bytes) if unit_bytes else None,
        "deferred_frees": _deferred_from(analysis),
        "freed_blocks_from_before_recording": {"count": len(early), "bytes": sum(b.size for b in early)},
        "phases": [{"name": n, "time": t} for n, t in tl.phases],
        "warnings": _warnings(analysis, _recording(snapshot).get("max_entries")),
    }


# ----------------------------------------------------------------------------------------------------------------
# engine-side hints (duck-typed: no torch import)


def _tensor_span(t: Any) -> tuple[int, int] | None:
    t = getattr(t, "_local_tensor", t)  # a DTensor (FSDP2) owns its storage through its local shard
    if not hasattr(t, "data_ptr") or not hasattr(t, "element_size") or getattr(t, "device", None) is None:
        return None
    if t.device.type in ("cpu", "meta") or t.numel() == 0:
        return None
    return int(t.data_ptr()), int(t.numel() * t.element_size())


def tensor_hints(module: Any, optimizer: Any = None) -> list[dict[str, Any]]:
    """``category_hints`` for a snapshot: the device addresses of ``module``'s parameters (and ZeRO-3
    ``ds_tensor`` shards), their gradients, its buffers, and ``optimizer``'s master weights and state.

    Blocks allocated before recording started carry no stack; these addresses let :func:`summarize` place them.
    ``optimizer`` may be an engine wrapper (its ``.optimizer`` is used) or a ``torch.optim`` optimizer.
    """
    hints: dict[int, dict[str, Any]] = {}

    def add(t: Any, category: str) -> None:
        span = _tensor_span(t)
        if span is not None and span[0] not in hints:
            hints[span[0]] = {"address": span[0], "size": span[1], "category": category}

    params = list(module.parameters()) if module is not None else []
    for p in params:
        add(p, PARAMS)
        add(getattr(p, "ds_tensor", None), PARAMS)
        add(getattr(p, "grad", None), GRADS)
    for b in module.buffers() if module is not None else ():
        add(b, BUFFERS)
    inner = getattr(optimizer, "optimizer", optimizer)
    for group in getattr(inner, "param_groups", None) or ():
        for p in group.get("params", ()):
            add(p, OPTIM)  # master weights (working parameters were added above and win)
            add(getattr(p, "grad", None), GRADS)
    for state in (getattr(inner, "state", None) or {}).values():
        for value in state.values() if isinstance(state, Mapping) else ():
            add(value, OPTIM)
    return list(hints.values())


# ----------------------------------------------------------------------------------------------------------------
# plotting and the command line


class MatplotlibMissingError(RuntimeError):
    """Raised by :func:`plot_timeline` when matplotlib is not installed."""


def _downsample(n: int, total: Sequence[int], limit: int) -> list[int]:
    """Indices of at most ~``limit`` points: the largest ``total`` of each stretch, so the peak survives."""
    if n <= limit:
        return list(range(n))
    stride = -(-n // limit)
    keep = [max(range(lo, min(lo + stride, n)), key=total.__getitem__) for lo in range(0, n, stride)]
    return sorted(set(keep) | {0, n - 1})


def plot_timeline(timeline: Timeline, png_path: str, title: str = "") -> None:
    """Write a stacked-area chart of ``timeline`` (GiB per category over time, peak marked) to ``png_path``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise MatplotlibMissingError("plot_timeline needs matplotlib: pip install matplotlib") from err
    keep = _downsample(len(timeline.total), timeline.total, 20_000)
    ms = timeline.time_unit == "us"
    xs = [timeline.times[i] / 1000.0 if ms else timeline.times[i] for i in keep]
    bands = [c for c in _STACK_ORDER if any(timeline.live[c])]
    ys = [[timeline.live[c][i] / 2**30 for i in keep] for c in bands]
    fig = Figure(figsize=(13, 6.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if bands:
        ax.stackplot(xs, ys, labels=bands, colors=[_COLORS[c] for c in bands], step="post", alpha=0.85)
    peak_x = timeline.times[timeline.peak_index] / (1000.0 if ms else 1.0)
    peak_gib = timeline.total[timeline.peak_index] / 2**30
    ax.axvline(peak_x, color="black", linestyle="--", linewidth=1)
    ax.annotate(f"peak {peak_gib:.3f} GiB", (peak_x, peak_gib), textcoords="offset points", xytext=(6, 6))
    for name, x in timeline.phases:
        xv = x / 1000.0 if ms else x
        if xs and xs[0] <= xv <= xs[-1]:
            ax.axvline(xv, color="grey", linewidth=0.8, linestyle=":")
            ax.text(xv, ax.get_ylim()[1] * 0.98, name, rotation=90, va="top", ha="right", fontsize=8)
    ax.set_xlabel("time since recording started (ms)" if ms else "allocator trace entry")
    ax.set_ylabel("allocated (GiB)")
    ax.set_title(title or "device memory by category")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


def _load(path: str) -> dict[str, Any]:
    with open(path, "rb") as fd:
        return pickle.load(fd)


def _default_device(snapshot: Mapping[str, Any]) -> int:
    recorded = _recording(snapshot).get("device")
    if isinstance(recorded, int):
        return recorded
    traces = snapshot.get("device_traces") or [[]]
    return max(range(len(traces)), key=lambda d: len(traces[d]))


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: summarise (and optionally plot) a pickled snapshot; prints the summary as JSON."""
    parser = argparse.ArgumentParser(description="Per-category memory timeline of a CUDA allocator snapshot.")
    parser.add_argument("snapshot", help="pickle written by torch.cuda.memory._dump_snapshot or memory_timeline")
    parser.add_argument("--png", help="write the stacked-area chart here (needs matplotlib)")
    parser.add_argument("--json", help="write the summary here as well")
    parser.add_argument("--unit-bytes", type=float, default=None, help="bytes of one gathered layer")
    parser.add_argument("--device", type=int, default=None, help="device index (default: the recorded one)")
    args = parser.parse_args(argv)
    snapshot = _load(args.snapshot)
    device = _default_device(snapshot) if args.device is None else args.device
    summary = summarize(snapshot, device, args.unit_bytes)
    text = json.dumps(summary, indent=2)
    if args.json:
        with open(args.json, "w") as fd:
            fd.write(text + "\n")
    if args.png:
        plot_timeline(build_timeline(snapshot, device), args.png, title=args.snapshot)
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
