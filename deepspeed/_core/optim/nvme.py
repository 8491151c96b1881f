"""ZeRO-3 optimizer state on NVMe (``offload_optimizer.device: "nvme"``): the fp32 master and the optimizer's
per-element states live in swap files, and the host holds only a few step chunks of them at a time.

[Note: nvme swap] Between steps every group's master and moments are files under
``<nvme_path>/zero_stage_3/optimizer/rank<global rank>/`` (upstream's names: ``<first>_<last>.tensor.swp`` for the
master of the group whose parameters have ids ``first..last``, ``<state>-<first>_<last>.tensor.swp`` for each
state). The master's ``.data`` is a one-element NaN placeholder expanded to the master's size, so its numel, dtype
and device stay right while anything that reads it by mistake sees NaN and any in-place write fails. The step walks
the groups' step chunks in order ([Note: chunked step]): each chunk's master and states are read into one of
``buffer_count`` page-aligned buffer sets, stepped exactly as the host-offload step steps that chunk, copied into
the parameters' shards, and written back to the files. With ``pipeline_read`` the reads of the next chunks are in
flight while a chunk steps; with ``pipeline_write`` a chunk's writes complete while the next ones step. The
gradient never goes to disk (it stays in the host accumulator or in the parameters' shards).

Faults: the files are allocated to their full size when created, so a full disk fails there with the path and the
bytes needed; before a step reads anything it checks that every file exists with its expected size, so a file
removed or truncated between steps stops the step before any state changes (the I/O op also refuses a short read:
nothing is ever read as zeros).

Checkpoints keep upstream's ZeRO-3 format: a save reads the state into memory for the duration of the save (one
full copy of this rank's master and moments, freed afterwards), a load writes it back to the files.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deepspeed._core.comm import dist
from deepspeed._core.config.plan import AioPolicy, OffloadDevice, RunPlan
from deepspeed._core.grads.convert import Coef
from deepspeed._core.grads.parked import ParkedWindow
from deepspeed._core.layout import swap_file
from deepspeed._core.optim import stage3_state
from deepspeed._core.optim.chunked_step import step_in_chunks
from deepspeed._core.optim.master import open_shard_of
from deepspeed._core.optim.sharded import OPTIMIZER_STEP_TIMER, OPTIMIZER_SWAP_IN_TIMER, OPTIMIZER_SWAP_OUT_TIMER
from deepspeed._core.optim.stage3 import Stage3Optimizer
from deepspeed._core.optim.stage3_access import Region
from deepspeed._core.params.param import ShardAccess
from deepspeed._foundation.logging import logger

NVME_AS_CPU_WARNING = (
    "zero_optimization.offload_optimizer.device='nvme' at ZeRO stage {stage}: optimizer state is kept in CPU memory "
    "(as upstream does); NVMe swapping needs stage 3"
)
MASTER_KEY = "fp32"  # the master's entry in a group's swap files


def warn_nvme_as_cpu(plan: RunPlan) -> None:
    """ZeRO-1/2 with ``device: nvme`` offload to the host, as upstream does; say so once."""
    if plan.zero.offload_optimizer.device is OffloadDevice.NVME and plan.zero.stage in (1, 2):
        logger.warning(NVME_AS_CPU_WARNING.format(stage=plan.zero.stage))


def swap_folder(nvme_path: str, global_rank: int) -> Path:
    """This rank's optimizer swap folder under ``nvme_path`` (upstream's layout)."""
    return Path(nvme_path) / "zero_stage_3" / "optimizer" / f"rank{global_rank}"


def _placeholder(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((1,), float("nan"), dtype=dtype).expand(numel)


def allocate_file(path: Path, nbytes: int) -> None:
    """Create ``path`` with ``nbytes`` reserved on disk, or raise naming the path and the bytes needed."""
    swap_file.allocate_file(path, nbytes, "zero_optimization.offload_optimizer.nvme_path")


@dataclass
class GroupFiles:
    """One optimizer group's swap files: the master's and each per-element state's, and their dtypes."""

    numel: int
    tag: str  # "<first>_<last>"
    folder: Path
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # key -> dtype; the master first

    def path(self, key: str) -> Path:
        """The file of ``key`` (the master or a state name), upstream's naming."""
        name = f"{self.tag}.tensor.swp" if key == MASTER_KEY else f"{key}-{self.tag}.tensor.swp"
        return self.folder / name

    def nbytes(self, key: str) -> int:
        """Expected size of ``key``'s file."""
        return self.numel * torch.empty((), dtype=self.dtypes[key]).element_size()

    def add(self, key: str, dtype: torch.dtype) -> None:
        """Create (allocate) ``key``'s file for a state first seen now."""
        self.dtypes[key] = dtype
        allocate_file(self.path(key), self.nbytes(key))

    def check(self) -> None:
        """Every file exists with its expected size; raise naming the file otherwise."""
        for key in self.dtypes:
            swap_file.check_file(self.path(key), self.nbytes(key), f"optimizer state ({key})")


@dataclass
class _Slot:
    """One buffer set: a chunk's master and states, with the handles of its reads and writes."""

    reader: Any
    writer: Any
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    writing: bool = False


@dataclass(frozen=True)
class Chunk:
    """One step chunk: group ``group``'s elements ``[start, end)``."""

    group: int
    start: int
    end: int


class NvmeSwapper:
    """The swap files of every group and the buffer sets the step streams them through ([Note: nvme swap]).

    Args:
        files: one :class:`GroupFiles` per optimizer group.
        chunk_numel: elements per step chunk (the buffers' size).
        offload: ``buffer_count``, ``pipeline_read``, ``pipeline_write``.
        aio: the ``aio_handle`` settings.
    """

    def __init__(self, files: list[GroupFiles], chunk_numel: int, offload: Any, aio: AioPolicy) -> None:
        self.files, self.chunk_numel = files, chunk_numel
        self.read_ahead = offload.pipeline_read
        self.write_behind = offload.pipeline_write
        op = swap_file.aio_module()
        widest = max((f.numel for f in files), default=0)
        self.width = max(1, min(chunk_numel, widest))
        self.slots = [
            _Slot(swap_file.open_handle(op, aio), swap_file.open_handle(op, aio))
            for _ in range(max(1, offload.buffer_count))
        ]
        self.backend = self.slots[0].reader.get_backend()
        self.bytes_read = self.bytes_written = 0
        # The phase timer the swap waits count under (the optimizer's ``timed``; nothing by default).
        self.timed: Callable[[str], AbstractContextManager[None]] = lambda name: contextlib.nullcontext()

    def chunks(self) -> list[Chunk]:
        """Every group's step chunks, in step order."""
        return [
            Chunk(g, start, min(start + self.chunk_numel, f.numel))
            for g, f in enumerate(self.files)
            for start in range(0, f.numel, self.chunk_numel)
        ]

    def _buffer(self, slot: _Slot, key: str, dtype: torch.dtype) -> torch.Tensor:
        buf = slot.buffers.get(key)
        if buf is None or buf.dtype != dtype:
            # Page-aligned, so the direct-I/O path reads into it without a bounce copy.
            buf = slot.reader.new_cpu_locked_tensor(self.width, torch.empty(0, dtype=dtype))
            slot.buffers[key] = buf
        return buf

    def _settle_write(self, slot: _Slot) -> None:
        if slot.writing:
            slot.writer.wait()
            slot.writing = False

    def _start_read(self, slot: _Slot, chunk: Chunk, keys: dict[str, torch.dtype]) -> None:
        with self.timed(OPTIMIZER_SWAP_OUT_TIMER):
            self._settle_write(slot)  # the buffers are free only once their last write is on disk
        files = self.files[chunk.group]
        with self.timed(OPTIMIZER_SWAP_IN_TIMER):
            for key, dtype in keys.items():
                buf = self._buffer(slot, key, dtype)[: chunk.end - chunk.start]
                slot.reader.async_pread(buf, str(files.path(key)), chunk.start * buf.element_size())
                self.bytes_read += buf.nbytes

    def reads_ahead(self) -> int:
        """Chunks read ahead of the one stepping: every other buffer set with ``pipeline_read``, but one fewer with
        ``pipeline_write`` too (three sets or more), so the set a chunk was just written from is not the next one
        read into: its write then completes while the next chunk steps instead of being waited for at once."""
        if not self.read_ahead:
            return 0
        keep_for_write = 2 if self.write_behind and len(self.slots) >= 3 else 1
        return max(0, len(self.slots) - keep_for_write)

    def stream(self) -> Iterator[tuple[Chunk, dict[str, torch.Tensor], Any]]:
        """Yield ``(chunk, buffers, done)`` for every chunk, its master and states read; the caller steps the buffers
        in place (adding states it creates to ``buffers``) and calls ``done()``, which writes them back."""
        chunks = self.chunks()
        for f in self.files:
            f.check()
        # What exists before this step is what every chunk reads: a state the first step creates is new in every
        # chunk of that step, even after an earlier chunk has created its file.
        keys = [dict(f.dtypes) for f in self.files]
        ahead = self.reads_ahead()
        for i in range(min(ahead + 1, len(chunks))):
            self._start_read(self.slots[i % len(self.slots)], chunks[i], keys[chunks[i].group])
        for i, chunk in enumerate(chunks):
            slot = self.slots[i % len(self.slots)]
            with self.timed(OPTIMIZER_SWAP_IN_TIMER):
                slot.reader.wait()
            n = chunk.end - chunk.start
            views = {key: slot.buffers[key][:n] for key in keys[chunk.group]}
            yield chunk, views, lambda c=chunk, s=slot, v=views: self._write(s, c, v)
            nxt = i + ahead + 1
            if nxt < len(chunks):
                self._start_read(self.slots[nxt % len(self.slots)], chunks[nxt], keys[chunks[nxt].group])
        with self.timed(OPTIMIZER_SWAP_OUT_TIMER):
            for slot in self.slots:
                self._settle_write(slot)

    def _write(self, slot: _Slot, chunk: Chunk, views: dict[str, torch.Tensor]) -> None:
        with self.timed(OPTIMIZER_SWAP_OUT_TIMER):
            self._write_untimed(slot, chunk, views)

    def _write_untimed(self, slot: _Slot, chunk: Chunk, views: dict[str, torch.Tensor]) -> None:
        files = self.files[chunk.group]
        for key, value in views.items():
            if key not in files.dtypes:
                files.add(key, value.dtype)  # a state the optimizer created on its first step
            buf = self._buffer(slot, key, value.dtype)[: value.numel()]
            if buf.data_ptr() != value.data_ptr():
                buf.copy_(value)
            slot.writer.async_pwrite(buf, str(files.path(key)), chunk.start * buf.element_size())
            self.bytes_written += buf.nbytes
        slot.writing = True
        if not self.write_behind:
            self._settle_write(slot)

    def read_full(self, group: int, key: str) -> torch.Tensor:
        """A fresh host tensor with the whole of ``group``'s ``key`` file."""
        files = self.files[group]
        files.check()
        out = torch.empty(files.numel, dtype=files.dtypes[key])
        self.slots[0].reader.sync_pread(out, str(files.path(key)))
        self.bytes_read += out.nbytes
        return out

    def write_full(self, group: int, key: str, value: torch.Tensor) -> None:
        """Replace ``group``'s ``key`` file with ``value`` (allocating it when new)."""
        files = self.files[group]
        if key not in files.dtypes:
            files.add(key, value.dtype)
        self.slots[0].writer.sync_pwrite(value.detach().contiguous(), str(files.path(key)))
        self.bytes_written += value.nbytes


class _ShiftedGrad:
    """A gradient object of the whole group seen from a chunk starting at ``base`` (the step sees ``[0, n)``)."""

    def __init__(self, grad: Any, base: int) -> None:
        self.grad, self.base = grad, base
        if hasattr(grad, "convert_into"):
            self.convert_into = lambda s, e, out, coef: grad.convert_into(base + s, base + e, out, coef)
        if hasattr(grad, "release"):
            self.release = lambda s, e: grad.release(base + s, base + e)

    def window(self, start: int, end: int) -> torch.Tensor:
        g = self.grad
        return (
            g.window(self.base + start, self.base + end)
            if hasattr(g, "window")
            else g[self.base + start : self.base + end]
        )


def _per_element(value: Any, numel: int) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == numel


def step_chunk(optimizer: torch.optim.Optimizer, index: int, chunk: Chunk, views: dict, ctx: dict) -> None:
    """Step one swapped-in chunk of group ``index`` in place, as the host-offload step steps that chunk.

    ``ctx`` carries the group's ``grad`` object and ``scalars`` (the optimizer's non-per-element state, e.g. the
    step count, as it was before this step; every chunk starts from it) and collects ``scalars_after``.
    """
    group = optimizer.param_groups[index]
    (master,) = group["params"]
    n = chunk.end - chunk.start
    view = torch.nn.Parameter(views[MASTER_KEY], requires_grad=False)
    states = {k: v for k, v in views.items() if k != MASTER_KEY}
    if states:  # an existing state: the chunk's per-element views plus the pre-step scalars
        optimizer.state[view] = {
            **states,
            **{k: v.clone() if torch.is_tensor(v) else v for k, v in ctx["scalars"].items()},
        }
    group["params"] = [view]
    try:
        step_in_chunks(optimizer, index, _ShiftedGrad(ctx["grad"], chunk.start), n, ctx["coef"], consume=True)
    finally:
        group["params"] = [master]
        after = optimizer.state.pop(view, {})
    for key, value in after.items():
        if _per_element(value, n):
            views[key] = value  # a state created on this first step joins the chunk's buffers
        else:
            ctx["scalars_after"][key] = value


def write_chunk_to_shards(writer: Any, chunk: Chunk, values: torch.Tensor) -> None:
    """Copy a stepped master chunk into the slices of the parameters' shards it covers (converted on the copy)."""
    for state, off in zip(writer.states, writer.offsets, strict=True):
        lo, hi = max(chunk.start, off), min(chunk.end, off + state.layout.partition_numel)
        if lo < hi:
            # A swapped partition is written back ([Note: nvme params]); read first only when the chunk covers
            # part of it.
            whole = lo == off and hi == off + state.layout.partition_numel
            with open_shard_of(state, ShardAccess.OVERWRITE if whole else ShardAccess.UPDATE) as shard:
                shard.reshape(-1)[lo - off : hi - off].copy_(values[lo - chunk.start : hi - chunk.start])


def stepped_scalars(ctx: dict) -> dict:
    """The non-per-element state after the step (unchanged when no chunk stepped)."""
    return ctx["scalars_after"] or ctx["scalars"]


def swap_update(opt: Any, coef: Coef) -> None:
    """The NVMe step of a ZeRO-3 optimizer ``opt``: every chunk swapped in, stepped, published, swapped out."""
    swapper: NvmeSwapper = opt.swapper
    if opt.plan.zero.offload_param.enabled:
        opt.manager.gatherer.sync_shard_reads()  # host shards a copy-in may still read ([Note: zero3-offload])
    ctxs: dict[int, dict] = {}
    for chunk, views, done in swapper.stream():
        ctx = ctxs.get(chunk.group)
        if ctx is None:
            master = opt.groups[chunk.group].master.param
            scalars = dict(opt.optimizer.state.get(master, {}))
            grad = opt.window_grad_for(chunk.group)
            ctx = ctxs[chunk.group] = {"grad": grad, "scalars": scalars, "scalars_after": {}, "coef": coef}
        step_chunk(opt.optimizer, chunk.group, chunk, views, ctx)
        write_chunk_to_shards(opt.groups[chunk.group].master.writer, chunk, views[MASTER_KEY])
        done()
    for g, ctx in ctxs.items():
        opt.optimizer.state[opt.groups[g].master.param] = stepped_scalars(ctx)
    opt.manager.refresh_persistent()


def build_swapper(opt: Any) -> NvmeSwapper:
    """Create this rank's swap folder and files, write every group's master there and evict it."""
    policy = opt.plan.zero.offload_optimizer
    folder = swap_folder(policy.nvme_path, dist.get_rank() if dist.is_initialized() else 0)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.tensor.swp"):
        stale.unlink()  # files of an earlier run in this folder are never read
    files = []
    for grp in opt.groups:
        ids = [s.ds_id for s in grp.states]
        tag = f"{ids[0]}_{ids[-1]}" if ids else "empty"
        files.append(GroupFiles(grp.master.numel(), tag, folder))
    sub_group = max(1, opt.plan.zero.sub_group_size)
    chunk = min(opt._step_chunk_numel, 1 << (sub_group.bit_length() - 1))  # a power of two keeps offsets aligned
    swapper = NvmeSwapper(files, chunk, policy, opt.plan.aio)
    for g, grp in enumerate(opt.groups):
        swapper.write_full(g, MASTER_KEY, grp.master.data)
        grp.master.param.data = _placeholder(grp.master.numel(), grp.master.dtype)
    logger.info(
        f"NVMe optimizer offload: {sum(f.nbytes(MASTER_KEY) for f in files)} bytes of fp32 master in {folder} "
        f"(async I/O backend: {swapper.backend}, buffer sets: {len(swapper.slots)})"
    )
    return swapper


class ResidentUse(enum.Enum):
    """What a :class:`Resident` block does with the state: only read it, or change it (written back after)."""

    READ = "read"
    UPDATE = "update"


class Resident:
    """Context: every group's master and states in host memory (checkpoints, module loads), swapped out after;
    with ``ResidentUse.UPDATE`` written back to the files first."""

    def __init__(self, opt: Any, use: ResidentUse = ResidentUse.UPDATE) -> None:
        self.opt, self.write = opt, use is ResidentUse.UPDATE

    def __enter__(self) -> None:
        opt = self.opt
        opt.resident = True
        for g, grp in enumerate(opt.groups):
            files = opt.swapper.files[g]
            grp.master.param.data = opt.swapper.read_full(g, MASTER_KEY)
            state = opt.optimizer.state.setdefault(grp.master.param, {})
            for key in files.dtypes:
                if key != MASTER_KEY:
                    state[key] = opt.swapper.read_full(g, key)

    def __exit__(self, *exc: object) -> None:
        opt = self.opt
        for g, grp in enumerate(opt.groups):
            state = opt.optimizer.state.get(grp.master.param, {})
            numel = grp.master.numel()
            if self.write and exc[0] is None:
                opt.swapper.write_full(g, MASTER_KEY, grp.master.data)
                for key, value in state.items():
                    if _per_element(value, numel):
                        opt.swapper.write_full(g, key, value)
            # A new dict, not deletions: a state_dict() taken inside holds this very dict (torch packs it unchanged).
            opt.optimizer.state[grp.master.param] = {k: v for k, v in state.items() if not _per_element(v, numel)}
            grp.master.param.data = _placeholder(numel, grp.master.dtype)
        opt.resident = False


class NvmeCheckpointFormat:
    """Upstream's ZeRO-3 checkpoint keys for an NVMe-swapped optimizer: the state is read in for the save and
    written out after a load."""

    @staticmethod
    def shard_state_dict(opt: Any, version: str) -> dict:
        """This rank's shard (as :func:`stage3_state.shard_state_dict`), read from the swap files."""
        with Resident(opt, ResidentUse.READ):
            return stage3_state.shard_state_dict(opt, version)

    @staticmethod
    def load_shards(opt: Any, shards: list[dict], load_optimizer_states: bool, load_from_fp32_weights: bool) -> None:
        """Restore the saved shards into the swap files."""
        with Resident(opt):
            stage3_state.load_shards(opt, shards, load_optimizer_states, load_from_fp32_weights)


class NvmeStage3Optimizer(Stage3Optimizer):
    """The ZeRO-3 optimizer with its master and optimizer states in NVMe swap files ([Note: nvme swap])."""

    checkpoint_format = NvmeCheckpointFormat  # type: ignore[assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resident = False
        self.swapper = build_swapper(self)
        self.swapper.timed = self.timed  # reads the engine's timers at each use (they are attached later)

    step_timers = [OPTIMIZER_SWAP_IN_TIMER, OPTIMIZER_STEP_TIMER, OPTIMIZER_SWAP_OUT_TIMER]

    def steps_during_backward(self) -> bool:
        """Never ([Note: early host step]): the swapped step reads each chunk's master and states from their files
        in order, pipelined, after the backward; it does not go through the overlapped host step."""
        return False

    def window_grad_for(self, index: int) -> Any:
        """Group ``index``'s gradient for the step: its accumulator, or the parked window over it."""
        grp = self.groups[index]
        acc = grp.ensure_accumulator()
        regions = self.parked.in_group(index)
        if not regions:
            return acc
        bufs = self._window_buffers
        if not bufs or bufs[0].dtype != acc.dtype:
            bufs = self._window_buffers = [
                torch.empty(self._step_chunk_numel, dtype=acc.dtype, pin_memory=grp.pin_memory) for _ in range(2)
            ]
        return ParkedWindow(acc, regions, bufs, self._step_chunk_numel, grp.master.numel())

    def _update(self, coef: Coef) -> None:
        # Swapping states in and out is part of the step here (upstream times it under two more names).
        with self.timed(OPTIMIZER_STEP_TIMER):
            swap_update(self, coef)
        self.parked.forget()  # the shards now hold the new values in place of any parked gradient

    def write_back(self) -> None:
        """Publish the masters to the shards (read from the swap files unless they are in memory now)."""
        if self.resident:
            super().write_back()
            return
        with Resident(self, ResidentUse.READ):
            super().write_back()

    def refresh_fp32_params(self) -> None:
        """Rebuild the masters from the parameters' shards, into the swap files."""
        with Resident(self):
            super().refresh_fp32_params()

    def _flat(self, region: Region, key: str | None) -> torch.Tensor:
        if self.resident:
            return super()._flat(region, key)
        files = self.swapper.files[region.group]
        name = MASTER_KEY if key is None else key
        if name not in files.dtypes:
            raise ValueError(f"optimizer state {key!r} does not exist (yet); known: {sorted(files.dtypes)}")
        return self.swapper.read_full(region.group, name)  # a copy: reads see the swapped state

    def _write(self, param: torch.nn.Parameter, key: str | None, values: torch.Tensor) -> None:
        with Resident(self):
            super()._write(param, key, values)

    def destroy(self) -> None:
        """Also remove this rank's swap files."""
        super().destroy()
        for f in self.swapper.files:
            for key in f.dtypes:
                f.path(key).unlink(missing_ok=True)
