"""ZenFlow at ZeRO-1/2 with the optimizer offloaded: important columns every step, the rest accumulated and late.

[Note: zenflow] Each rank's fp32 master partition is split in two. *Selected* elements are stepped
every step with that step's gradient: the ``ceil(topk_ratio * C)`` columns of largest gradient norm of every 2-D
weight (``C`` columns; the norms are summed over the ranks' rows with one all-reduce, so every rank selects the
same columns), and every element of a parameter that is not 2-D. The other elements' gradients are added into an
fp32 accumulator; every ``update_interval`` steps (or, ``"auto"``, when the accumulated mass has caught up, see
:class:`AutoInterval`) the host optimizer steps them once with the mean accumulated gradient. With
``overlap_step`` that host update is computed on a worker thread while the next forward and backward run, and it
is written into the master (and so into the working weights) at the next step boundary: one step late. The
columns are selected again only when the accumulator is empty (just after a host update was applied).

Each path keeps its own scalar optimizer state (Adam's step count), so that bias correction counts the updates an
element actually received; the per-element moments are the master's. The first ``full_warm_up_rounds`` steps
select every element; the delayed path then starts from the step count they reached. A path's update goes through
the inner optimizer on a packed copy of its elements (gather, step, scatter), which are elementwise
the same operations as the plain offloaded step.

[Note: zenflow deferred accumulation] Adding a step's gradient into the accumulator is a full pass over the
partition, the largest piece of host work a step without a host update has, and nothing in the step needs its
result: the accumulator is read only by the host update, which the worker runs after it (one worker, jobs in
order) or which waits for it. So ``step()`` hands the addition to the worker and returns, and it runs beside the
next forward. It reads the partition gradients the step was given, which stay as they are until the next
backward writes them: :meth:`ZenFlowUpdate.finish_accumulating`, called before every backward and before
anything reads the accumulators or changes the split or the schedule, waits for it. The same operations run on
the same values, so the sums are the ones the training thread would have formed.

[Note: zenflow in-place host update] Once the selected columns are stepped where the working weights live
([Note: zenflow columns]), the training thread neither reads nor writes the host master or its moments between
two syncs of the columns, and the host copies of the selected elements are stale until the next sync overwrites
them. So the background host update steps the whole partition in place with the accumulator (zero on the
selected elements) and the late path's step count: the late elements get their update, the selected elements' host
copies stay stale (stepped with a zero gradient) until that sync. Packing the late elements instead, and scattering
them back at the next step boundary on the training thread, moved about nine tenths of the partition three times
each way and held packed copies of the master and both moments for the duration. Applying an in-place update at the
boundary is only bookkeeping: the step count, and a full publish. It starts once the step's weights are published
(:meth:`ZenFlowUpdate.start_host_update`), since a full publish reads the master, and anything that reads or writes
the host master or its moments from outside a step (the columns' sync, a save, ``safe_get_*``) waits for it first.
A master read then already holds the update; the working weights get it at the next step boundary, as before. The
late path's first update starts from zero moments, created afresh over the whole partition. With the every-step path
on the host, the background update is packed and scattered as above.

[Note: zenflow checkpoint] A checkpoint holds everything ZenFlow keeps between steps (:meth:`ZenFlowUpdate.
state_dict`): the accumulator, the selected columns, the counters of the schedule, both paths' step counts and a
host update still in flight, waited for but not applied, so that the resumed run applies it one step late as the
uninterrupted one does. A packed update is saved as the values and moments it writes at the next step boundary; an
in-place one has already written them into the master and moments the checkpoint holds, so the checkpoint also
holds this rank's working partition, which the load publishes instead of the master until that boundary. The
accumulator and the update in flight are partition-shaped and are re-sliced like the master on loading, so a
checkpoint loads at any data-parallel size; the split is rebuilt from the (global) selected columns.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from deepspeed._core.comm.collectives import sum_over
from deepspeed._core.config.plan import ZenFlowPolicy
from deepspeed._core.grads.convert import Coef, convert_scaled, scales
from deepspeed._core.layout.shards import Range
from deepspeed._core.optim.zenflow_device import (
    ColumnGradGather,
    ColumnGradUpload,
    DeviceColumns,
    adam_rule_of,
    scaled_fp32,
)
from deepspeed._core.optim.zenflow_schedule import AutoInterval
from deepspeed._core.optim.zenflow_split import ColumnPiece, ColumnSplit, column_sq
from deepspeed._core.optim.zenflow_state import (
    ACCUMULATOR,
    PENDING_REST,
    PENDING_STATE,
    PENDING_VALUES,
    PENDING_WORKING,
    STATE_FORMAT,
    PendingUpdate,
    copied,
    restored_pending,
    unpacked,
)

ACCUMULATE_CHUNK = 1 << 22  # elements converted and scaled at a time on their way into the accumulator


@dataclass
class GroupSplit:
    """One flat group's split: the pieces of its 2-D weights, which elements are stepped every step (as column
    indices, [Note: zenflow split]) and the accumulated gradient of the other elements."""

    numel: int
    pieces: list[ColumnPiece]
    split: ColumnSplit
    acc: torch.Tensor | None = None


@dataclass
class PathScalars:
    """The scalar optimizer state (step count) of the every-step path and of the host path."""

    selected: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)


class ZenFlowUpdate:
    """The ZenFlow update of a ZeRO-1/2 optimizer's offloaded masters ([Note: zenflow]).

    Args:
        optimizer: the inner optimizer (one master parameter per group).
        policy: the ``zenflow`` block.
        layouts: per group, ``(partition start, partition numel, [(flat offset, shape) per parameter])``.
        group: the process group the partitions are spread over.
        device: where the working weights live: the selected columns are stepped there once chosen
            ([Note: zenflow columns]); ``None`` keeps them on the host.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        policy: ZenFlowPolicy,
        layouts: list,
        group: Any,
        device: torch.device | None = None,
    ) -> None:
        self.optimizer, self.policy, self.group = optimizer, policy, group
        # [Note: zenflow columns]: where and by which rule the selected columns are stepped (None: on the host)
        self.device, self.rule = device, (adam_rule_of(optimizer) if device is not None else None)
        self.gather = ColumnGradGather() if self.rule is not None else None  # their gradient, from the backward
        self.columns: dict[int, DeviceColumns] = {}
        self.groups: list[GroupSplit] = []
        self.widths: list[int] = []  # columns of every 2-D weight, in norm-vector order
        for start, numel, params in layouts:
            self.groups.append(
                GroupSplit(numel, pieces := self._pieces(start, numel, params), ColumnSplit(numel, pieces, None))
            )
        self.scalars = [PathScalars() for _ in self.groups]
        self.steps = self.accumulated = 0
        self.epoch_steps, self.selected_once, self._select_requested = policy.steps_per_epoch, False, False
        self._chosen: list[torch.Tensor] = []
        self.auto = AutoInterval(policy.auto_ratio, len(self.widths)) if policy.update_interval == "auto" else None
        self.pending: PendingUpdate | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._twin: torch.optim.Optimizer | None = None
        self._accumulating: Future | None = None  # [Note: zenflow deferred accumulation]
        self._scratch: torch.Tensor | None = None  # the addition's fp32 chunk
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}
        self._grad_uploads: dict[int, ColumnGradUpload] = {}  # per group, while the columns stand
        self._device_splits: dict[tuple[int, str, int, int], tuple[int, ColumnSplit]] = {}
        # Whether the last step may have changed elements outside the every-step path (a host update landed, every
        # element was stepped), and so publishes the whole master; _publish_all: the next step does (host copies set).
        self.changed_all, self._publish_all = True, True
        self._stepped: dict[int, torch.Tensor] = {}  # per group: the every-step path's values after the step
        # For tests: steps publishing the selected columns alone, group steps on the device (and on a gradient
        # gathered there), host updates applied (and of them in place), column selections made.
        self.partial_publishes = self.column_steps = self.gathered_steps = self.selections = 0
        self.host_updates = self.in_place_updates = 0

    def _pieces(self, start: int, numel: int, params: list) -> list[ColumnPiece]:
        pieces = []
        for offset, shape in params:
            if len(shape) != 2:
                continue
            cols = int(shape[1])
            lo, hi = max(offset, start), min(offset + int(shape[0]) * cols, start + numel)
            if hi > lo:
                pieces.append(ColumnPiece(lo - start, lo - offset, hi - lo, cols, sum(self.widths)))
            self.widths.append(cols)
        return pieces

    # --- schedule ---------------------------------------------------------------------------------------
    def _select_interval(self) -> int:
        """Steps between selections (0: select once)."""
        policy = self.policy
        every = 1 if policy.select_strategy == "auto" else int(policy.select_interval)
        if policy.select_strategy == "step":
            return every
        return every * self.epoch_steps if self.epoch_steps else 0

    def use_epoch_length(self, steps: int) -> None:
        """Optimizer steps per epoch of the training data loader, unless ``steps_per_epoch`` was given."""
        if self.policy.steps_per_epoch is None and steps > 0:
            self.epoch_steps = steps

    def _selection_due(self) -> bool:
        """A selection is asked for every select interval and runs at the first step after it at which the
        accumulator is empty (the accumulated gradients belong to the current split)."""
        interval = self._select_interval()
        since = self.steps - self.policy.full_warm_up_rounds
        if interval > 0 and since > 0 and since % interval == 0:
            self._select_requested = True
        return not self.accumulated and (not self.selected_once or self._select_requested)

    def _host_due(self) -> bool:
        if not self.accumulated:
            return False
        if self.auto is not None:
            return self.auto.due()
        return self.accumulated >= int(self.policy.update_interval)

    # --- one step ---------------------------------------------------------------------------------------
    def step(self, grads: Sequence[torch.Tensor | None], coef: Coef) -> None:
        """Apply one ZenFlow step with the partition gradients ``grads`` (one per group) scaled by ``coef``."""
        self.changed_all, self._stepped, self._publish_all = self._publish_all, {}, False
        self.finish_accumulating()
        self.settle()
        raws = [torch.zeros(m.numel) if g is None else g for g, m in zip(grads, self.groups, strict=True)]
        warm = self.steps < self.policy.full_warm_up_rounds
        select = not warm and self._selection_due()
        norms = self._column_norms(raws, coef) if select or (not warm and self.auto is not None) else None
        if select:
            assert norms is not None
            self._select(norms)
        for index, raw in enumerate(raws):
            if self.rule is not None and self.groups[index].split.counts[1]:
                self._step_columns(index, raw, coef)
            else:
                self._step_selected(index, self._selected_grad(index, raw, coef), self.scalars[index])
        if not warm:
            self._accumulate(raws, coef, norms)
        if self.steps + 1 == self.policy.full_warm_up_rounds:
            for scalars in self.scalars:  # every element had every warm-up update: the host path starts there
                scalars.host = copied(scalars.selected)
        self.steps += 1
        if self._host_due():
            self._host_update()

    def _buffer(self, index: int, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer kept from step to step (until the columns change): the every-step path packs into the
        same memory each step instead of faulting in fresh pages."""
        key = (index, name)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype)
        return buf

    def _selected_grad(self, index: int, raw: torch.Tensor, coef: Coef) -> torch.Tensor:
        """This step's gradient of the every-step path, packed, in fp32 and scaled by ``coef``."""
        split = self.groups[index].split
        packed = split.take(raw, True, out=self._buffer(index, "grad", split.counts[0], raw.dtype))
        if raw.dtype == torch.float32 and not scales(coef):
            return packed
        out = self._buffer(index, "grad32", split.counts[0], torch.float32)
        convert_scaled(out, packed, coef)
        return out

    def _column_norms(self, raws: Sequence[torch.Tensor], coef: Coef) -> list[torch.Tensor]:
        """Every 2-D weight's column norms of this step's gradient (scaled by ``coef``), summed over the ranks."""
        total = torch.zeros(sum(self.widths), dtype=torch.float32)
        for grad, group in zip(raws, self.groups, strict=True):
            for piece in group.pieces:
                part = grad[piece.local : piece.local + piece.numel]
                total[piece.norm_offset : piece.norm_offset + piece.cols] += column_sq(
                    part, piece.first, piece.cols, coef
                )
        if self.group is not None or torch.distributed.is_initialized():
            sum_over(total, self.group)
        return list(total.sqrt().split(self.widths)) if self.widths else []

    def _select(self, norms: list[torch.Tensor]) -> None:
        """Choose the columns stepped every step (the same on every rank) and rebuild the split."""
        chosen = []
        for norm in norms:
            keep = torch.zeros(norm.numel(), dtype=torch.bool)
            count = min(norm.numel(), max(1, math.ceil(self.policy.topk_ratio * norm.numel())))
            keep[torch.topk(norm, count, sorted=False).indices] = True
            chosen.append(keep)
        self.sync_columns(drop=True)  # the host copies of the outgoing columns become current again
        self._apply_columns(chosen)
        self._publish_all = False  # this step publishes everything itself (changed_all), the next need not
        self.selected_once, self._select_requested = True, False
        self.selections += 1

    def _apply_columns(self, chosen: list[torch.Tensor]) -> None:
        """Rebuild this rank's split from the selected columns of every 2-D weight (none: every element)."""
        offsets = [sum(self.widths[:i]) for i in range(len(self.widths))]
        for group in self.groups:
            keeps = [chosen[offsets.index(piece.norm_offset)] for piece in group.pieces] if chosen else None
            group.split = ColumnSplit(group.numel, group.pieces, keeps)
        self._chosen = chosen
        self._buffers.clear()
        self._device_splits.clear()
        for upload in self._grad_uploads.values():
            upload.wait()  # its buffer is dropped: no copy may still read it
        self._grad_uploads.clear()
        self.columns.clear()  # without writing back: a load replaced the host copies, or _select already did
        self.changed_all, self._stepped, self._publish_all = True, {}, True

    def _accumulate(self, raws: Sequence[torch.Tensor], coef: Coef, norms: list[torch.Tensor] | None) -> None:
        """Hand this step's gradient of the masked-out elements to the worker, to be added into the accumulators
        ([Note: zenflow deferred accumulation])."""
        if all(not g.split.counts[1] for g in self.groups):
            return
        self.accumulated += 1
        if self.auto is not None and norms is not None:
            self.auto.observe(norms, self._chosen)
        self._accumulating = self._executor().submit(self._add_to_accumulators, list(raws), coef)

    def finish_accumulating(self) -> None:
        """Wait for the last step's gradients to be in the accumulators ([Note: zenflow deferred accumulation])."""
        job, self._accumulating = self._accumulating, None
        if job is not None:
            job.result()

    def _add_to_accumulators(self, raws: list[torch.Tensor], coef: Coef) -> None:
        """Worker: add ``raws`` (scaled by ``coef``) into the accumulators.

        Every element is added, a chunk at a time through one small fp32 buffer, and the every-step path's
        elements are set back to zero after: cheaper than zeroing them in a full-size fp32 copy of the gradient,
        and the masked-out elements see the same sums."""
        for raw, group in zip(raws, self.groups, strict=True):
            if group.acc is None:
                group.acc = torch.zeros(group.numel, dtype=torch.float32)
            if raw.dtype == torch.float32 and not scales(coef):
                group.acc.add_(raw)
            else:
                numel = min(ACCUMULATE_CHUNK, group.numel)
                if self._scratch is None or self._scratch.numel() < numel:
                    self._scratch = torch.empty(numel, dtype=torch.float32)
                for lo in range(0, group.numel, numel):
                    chunk = self._scratch[: min(numel, group.numel - lo)]
                    convert_scaled(chunk, raw[lo : lo + chunk.numel()], coef)
                    group.acc[lo : lo + chunk.numel()].add_(chunk)
            group.split.fill_(group.acc, 0.0, True)

    def _host_update(self) -> None:
        """Step the masked-out elements once with the mean accumulated gradient (now, or in the background)."""
        count = self.accumulated
        self.accumulated = 0
        if self.auto is not None:
            self.auto.reset()
        if not self.policy.overlap_step:
            self.finish_accumulating()
            for index in range(len(self.groups)):
                self._late_in_place(index, count)
            self.host_updates += 1
            self.changed_all = True
            return
        snapshot = [dict(g) for g in self.optimizer.param_groups]  # this step's hyperparameters
        if self._in_place_ok():  # [Note: zenflow in-place host update]: started once the weights are published
            self.pending = PendingUpdate(None, in_place=True, due=(count, snapshot))
        else:
            self.pending = PendingUpdate(self._executor().submit(self._background, count, snapshot))

    def _in_place_ok(self) -> bool:
        """Whether the background update may step the host master in place: the every-step path is off the host
        ([Note: zenflow in-place host update])."""
        return self.rule is not None

    def take_loaded_working(self) -> list[torch.Tensor] | None:
        """The working partitions a load brought with an in-place update in flight (once): published instead of the
        masters, which hold the update already ([Note: zenflow checkpoint])."""
        if self.pending is None:
            return None
        working, self.pending.working = self.pending.working, None
        return working

    def start_host_update(self) -> None:
        """Start an in-place host update this step made due; called once the step's weights are published."""
        pending = self.pending
        if pending is not None and pending.due is not None:
            pending.job, pending.due = self._executor().submit(self._update_in_place, *pending.due), None

    def _wait_in_place(self) -> None:
        """Before the training thread touches the host master or its moments: an in-place update is done with them."""
        self.start_host_update()
        if self.pending is not None and self.pending.in_place:
            assert self.pending.job is not None
            self.pending.job.result()

    def _late_in_place(self, index: int, count: int) -> None:
        """The late path's update of group ``index`` on the training thread, over the whole master at once.

        Packing the late path's elements (most of them) would fault in fresh pages for four near-partition-size
        copies. Instead the inner optimizer steps the whole partition with the accumulator (zero on the every-step
        path's elements) as its gradient and the late path's step count. With the every-step path on the host its
        elements of the master and its state are set aside in the kept buffers first and written back after;
        with device columns their host copies are stale anyway ([Note: zenflow in-place host update]). Elementwise
        this is the late path's packed step, its first one (no step count yet) included (:meth:`_step_whole`).
        """
        group, split, scalars = self.groups[index], self.groups[index].split, self.scalars[index]
        if group.acc is None or not split.counts[1]:
            return  # every element of this group is on the every-step path
        master = self.optimizer.param_groups[index]["params"][0]
        kept = self._pack(index, selected=True) if self.rule is None else None
        scalars.host = self._step_whole(self.optimizer, index, index, scalars.host, group.acc.div_(count))
        if kept is not None:
            state = self.optimizer.state[master]
            split.put_(master.data, kept[0], True)
            for key, value in kept[1].items():
                split.put_(state[key], value, True)
        group.acc.zero_()

    def _step_whole(self, optimizer: torch.optim.Optimizer, slot: int, index: int, scalars: dict, grad: Any) -> dict:
        """Step group ``index``'s whole master and moments in place on ``optimizer``'s param group ``slot`` with
        ``grad`` and the late path's ``scalars``; returns the new scalars.

        The late path's first step (no ``scalars`` yet) starts from zero moments: the master's moments are dropped
        first (the late elements' are zero until then, the every-step path's are set aside by the caller or stale),
        and the ones the optimizer creates afresh, partition-sized, become the master's."""
        master = self.optimizer.param_groups[index]["params"][0]
        own = self.optimizer.state.setdefault(master, {})
        # A copy taken at once: on the worker, the training thread may set the state's step count meanwhile.
        state = dict(own)
        per_element = {k: v for k, v in state.items() if _per_element(v, master.numel())}
        if not scalars:
            for key in per_element:
                own.pop(key, None)
            per_element = {}
        new_values, new_state, new_scalars = _step_packed(optimizer, slot, master.data, per_element, scalars, grad)
        assert new_values.data_ptr() == master.data_ptr()
        for key, value in new_state.items():
            if key not in per_element:
                own[key] = value  # created afresh over the whole partition
            elif value.data_ptr() != per_element[key].data_ptr():  # an optimizer that replaced a moment
                per_element[key].copy_(value)
        return new_scalars

    def settle(self) -> None:
        """Apply the background host update of the previous step, if any (waits for it)."""
        self.start_host_update()
        pending, self.pending = self.pending, None
        if pending is None:
            return
        assert pending.job is not None  # started above
        if pending.in_place:  # the master and moments hold it already: only its step counts are left
            for index, scalars in pending.job.result():
                self.scalars[index].host = scalars
            self.changed_all = True
            self.host_updates += 1
            self.in_place_updates += 1
            return
        # No selection runs between the update's start and here, so the late path's elements are still the
        # ones it packed.
        for index, values, state, scalars in pending.job.result():
            self.groups[index].split.put_(self.optimizer.param_groups[index]["params"][0].data, values, False)
            self._scatter_state(index, state, selected=False)
            self.scalars[index].host = scalars
        self.changed_all = True
        self.host_updates += 1

    # --- the every-step path on the device ([Note: zenflow columns]) ----------------------------------------
    def _step_columns(self, index: int, raw: torch.Tensor, coef: Coef) -> None:
        """Step group ``index``'s selected elements where the working weights live with ``raw``'s selected elements
        scaled by ``coef``; the host keeps its step count (what a checkpoint saves) but not their values until
        :meth:`sync_columns`."""
        assert self.device is not None and self.rule is not None
        columns = self.columns.get(index)
        if columns is None:
            columns = self.columns[index] = self._upload(index)
        gathered = None if self.gather is None else self.gather.take(index, self.groups[index].split)
        if gathered is not None:  # [Note: zenflow columns]: gathered on the device during the backward
            grad = scaled_fp32(gathered, coef)
            self.gathered_steps += 1
        else:
            upload = self._grad_uploads.setdefault(index, ColumnGradUpload(self.device))
            grad = upload.send(self.groups[index].split, raw, coef)
        columns.step_(grad, self.optimizer.param_groups[index], self.rule)
        self.column_steps += 1
        self._stepped[index] = columns.master
        self.scalars[index].selected = {"step": columns.step}
        master = self.optimizer.param_groups[index]["params"][0]
        self.optimizer.state.setdefault(master, {})["step"] = columns.step

    def _upload(self, index: int) -> DeviceColumns:
        """Group ``index``'s selected master and moments (zero moments on the path's first step), packed and sent."""
        assert self.device is not None
        self._wait_in_place()
        split, master = self.groups[index].split, self.optimizer.param_groups[index]["params"][0]
        state = self.optimizer.state.get(master, {})

        def packed(value: torch.Tensor | None) -> torch.Tensor:
            if value is None:
                return torch.zeros(split.counts[0], dtype=torch.float32, device=self.device)
            return split.take(value, True).to(self.device)

        step = int(self.scalars[index].selected.get("step", 0))
        moments = [state.get(key) if step else None for key in ("exp_avg", "exp_avg_sq")]
        return DeviceColumns(packed(master.data), packed(moments[0]), packed(moments[1]), step)

    def sync_columns(self, drop: bool = False) -> None:
        """Write the device columns' master and moments back into the host copies, and forget the columns with
        ``drop``: before anything reads the whole master or its state on the host."""
        self._wait_in_place()
        for index, columns in self.columns.items():
            split, master = self.groups[index].split, self.optimizer.param_groups[index]["params"][0]
            state = self.optimizer.state.setdefault(master, {})
            split.put_(master.data, columns.master.to(master.device), True)
            for key, value in (("exp_avg", columns.exp_avg), ("exp_avg_sq", columns.exp_avg_sq)):
                if key not in state:
                    state[key] = torch.zeros(master.numel(), dtype=torch.float32)
                split.put_(state[key], value.to(master.device), True)
            state["step"] = columns.step
        if drop:
            self.drop_columns()

    def drop_columns(self) -> None:
        """Forget the device columns without writing them back (the host copies were just replaced); the next
        step publishes the whole master."""
        self.columns.clear()
        self._publish_all = True

    # --- masked steps -----------------------------------------------------------------------------------
    def stepped_values(self, index: int) -> torch.Tensor | None:
        """The every-step path's values of group ``index`` after the last step (packed, master dtype) when they
        are all that step changed, else ``None`` (publish the whole master)."""
        return None if self.changed_all else self._stepped.get(index)

    def open_window(self) -> None:
        """A window's first backward starts: from here the selected columns' gradient is gathered on the device as
        it is delivered ([Note: zenflow columns]). A window closed before its step stays closed."""
        if self.gather is not None:
            self.gather.begin({i: g.split for i, g in enumerate(self.groups)})

    def close_window(self) -> None:
        """The window's gradients were stepped, dropped, or written on the host: what was gathered is void."""
        if self.gather is not None:
            self.gather.close()

    def gather_piece(self, index: int, local: Range, piece: torch.Tensor, adds: bool, dtype: torch.dtype) -> None:
        """``PartitionGrads.sunk``: the selected elements of ``piece`` (partition elements ``local``, headed for a
        partition gradient of ``dtype``) into the device gather, when group ``index``'s columns are stepped on the
        device."""
        gather, split = self.gather, self.groups[index].split
        if gather is None or not gather.open or gather.splits.get(index) is not split or not split.counts[1]:
            return
        offset, window = self.split_on(index, piece.device, local.start, local.end)
        if window.counts[0]:
            gather.land(index, split.counts[0], dtype, offset, window.take(piece, True), adds)

    def device_values(self, index: int) -> torch.Tensor | None:
        """Group ``index``'s every-step path's master values where they are stepped on the device (packed), else
        ``None``: the host copies of these are stale until :meth:`sync_columns`."""
        columns = self.columns.get(index)
        return None if columns is None else columns.master

    def split_on(
        self, index: int, device: torch.device, start: int = 0, end: int | None = None
    ) -> tuple[int, ColumnSplit]:
        """Group ``index``'s split of its partition's elements ``[start, end)`` (default: all) with its indices on
        ``device``, and where their selected elements begin in the packed order (kept while the columns stand)."""
        split = self.groups[index].split
        end = split.numel if end is None else end
        key = (index, str(device), start, end)
        if key not in self._device_splits:
            offset, window = split.window(start, end) if (start, end) != (0, split.numel) else (0, split)
            self._device_splits[key] = (offset, window.to(device))
        return self._device_splits[key]

    def _pack(self, index: int, selected: bool) -> tuple[torch.Tensor, dict]:
        """Copies of the master's and its per-element state's values on one path (the every-step path's in
        buffers kept from step to step; the late path's are fresh, a background update holds them)."""
        master = self.optimizer.param_groups[index]["params"][0]
        state = self.optimizer.state.get(master, {})
        split = self.groups[index].split

        def take(name: str, value: torch.Tensor) -> torch.Tensor:
            if selected and not split.counts[1]:
                return value  # every element is on this path (warm-up): step the master and its state in place
            out = self._buffer(index, name, split.counts[0], value.dtype) if selected else None
            return split.take(value, selected, out=out)

        per_element = {k: take(f"state.{k}", v) for k, v in state.items() if _per_element(v, master.numel())}
        return take("master", master.data), per_element

    def _scatter_state(self, index: int, packed: dict, selected: bool) -> None:
        master = self.optimizer.param_groups[index]["params"][0]
        state = self.optimizer.state.setdefault(master, {})
        for key, value in packed.items():
            if key not in state:
                state[key] = torch.zeros(master.numel(), dtype=value.dtype)
            if value is not state[key]:
                self.groups[index].split.put_(state[key], value, selected)

    def _step_selected(self, index: int, grad: torch.Tensor, scalars: PathScalars) -> None:
        """Step group ``index``'s every-step path with ``grad`` (packed) on the host, on the training thread."""
        if not grad.numel():
            return
        values, state = self._pack(index, selected=True)
        new_values, new_state, new_scalars = _step_packed(self.optimizer, index, values, state, scalars.selected, grad)
        master = self.optimizer.param_groups[index]["params"][0]
        if new_values.data_ptr() != master.data_ptr():
            self.groups[index].split.put_(master.data, new_values, True)
            self._stepped[index] = new_values
        else:
            self.changed_all = True  # the whole master was stepped in place
        self._scatter_state(index, new_state, selected=True)
        scalars.selected = new_scalars
        # The optimizer's own state of the master carries the every-step path's scalars (what a checkpoint saves).
        self.optimizer.state[master].update(copied(new_scalars))

    def _background(self, count: int, snapshot: list[dict]) -> list:
        """Worker: pack every group's masked-out elements and their mean accumulated gradient, and step them on
        the twin optimizer with ``snapshot``'s hyperparameters.

        The packing runs here, off the training thread: until :meth:`settle` nothing else writes the master, its
        state or the accumulators (the weights are only read, to publish them), and the split does not change.
        """
        twin = self._twin_optimizer()
        out = []
        for index, group in enumerate(self.groups):
            assert group.acc is not None
            grad = group.split.take(group.acc, False).div_(count)
            group.acc.zero_()
            values, state = self._pack(index, selected=False)
            twin.param_groups[0].update({k: v for k, v in snapshot[index].items() if k != "params"})
            new_values, new_state, new_scalars = _step_packed(twin, 0, values, state, self.scalars[index].host, grad)
            out.append((index, new_values, new_state, new_scalars))
        return out

    def _update_in_place(self, count: int, snapshot: list[dict]) -> list[tuple[int, dict]]:
        """Worker: step every group's late elements in place with the mean accumulated gradient on the twin
        optimizer with ``snapshot``'s hyperparameters ([Note: zenflow in-place host update]); returns each stepped
        group's new step count."""
        twin = self._twin_optimizer()
        out = []
        for index, group in enumerate(self.groups):
            if group.acc is None or not group.split.counts[1]:
                continue
            twin.param_groups[0].update({k: v for k, v in snapshot[index].items() if k != "params"})
            scalars = self._step_whole(twin, 0, index, self.scalars[index].host, group.acc.div_(count))
            group.acc.zero_()
            out.append((index, scalars))
        return out

    def _twin_optimizer(self) -> torch.optim.Optimizer:
        """A second instance of the inner optimizer's class for the worker, so that the training thread's
        optimizer (and a scheduler changing its learning rate) is never touched from the worker."""
        if self._twin is None:
            kwargs = dict(self.optimizer.defaults)
            for attr, name in (("adam_w_mode", "adamw_mode"), ("fp32_optimizer_states", "fp32_optimizer_states")):
                if hasattr(self.optimizer, attr):
                    kwargs[name] = getattr(self.optimizer, attr)
            accepted = inspect.signature(type(self.optimizer)).parameters
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
                kwargs = {k: v for k, v in kwargs.items() if k in accepted}  # e.g. AdamW's fixed decoupling flag
            placeholder = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
            try:
                self._twin = type(self.optimizer)([placeholder], **kwargs)
            except TypeError as err:
                raise ValueError(
                    f"zero_optimization.zenflow.overlap_step needs a second {type(self.optimizer).__name__} built "
                    f"from its defaults, which failed ({err}); set overlap_step false"
                ) from err
        return self._twin

    def _executor(self) -> ThreadPoolExecutor:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds-zenflow")
        return self._worker

    # --- checkpoints ([Note: zenflow checkpoint]) ---------------------------------------------------------
    def state_dict(self, working: Callable[[int], torch.Tensor] | None = None) -> dict:
        """What this rank's ZenFlow holds between steps. ``"partitions"`` maps a name to one tensor per group,
        shaped like that group's master partition; every other entry is the same on every rank.

        ``working(index)``: group ``index``'s working partition on the host, saved with an in-place update in flight
        ([Note: zenflow checkpoint]); required then."""
        self.finish_accumulating()
        self.start_host_update()
        if self.pending is not None and self.pending.job is not None:  # started above
            self.pending.job.result()  # the worker empties the accumulators it packed: read them after it
        partitions: dict[str, list[torch.Tensor]] = {}
        accs = [g.acc for g in self.groups]
        if accs and all(a is not None for a in accs):
            partitions[ACCUMULATOR] = [a.clone() for a in accs if a is not None]
        return {
            "format": STATE_FORMAT,
            "column_widths": list(self.widths),
            "steps": self.steps,
            "accumulated": self.accumulated,
            "selected_once": self.selected_once,
            "select_requested": self._select_requested,
            "selected_columns": [c.clone() for c in self._chosen],
            "step_counts": [{"selected": copied(s.selected), "host": copied(s.host)} for s in self.scalars],
            "auto_interval": None if self.auto is None else self.auto.state_dict(),
            "pending_host_step_counts": self._save_pending(partitions, working),
            "host_updates": self.host_updates,
            "selections": self.selections,
            "partitions": partitions,
        }

    def _save_pending(
        self, partitions: dict[str, list[torch.Tensor]], working: Callable[[int], torch.Tensor] | None
    ) -> list[dict] | None:
        """Put a host update in flight into ``partitions`` (unpacked to partition shape, or for an in-place one the
        working partitions it is not published to yet); its step counts."""
        if self.pending is None or self.pending.job is None:
            return None
        if self.pending.in_place:
            assert working is not None, "an in-place host update in flight is saved with the working partitions"
            stepped = dict(self.pending.job.result())
            partitions[PENDING_WORKING] = [working(index) for index in range(len(self.groups))]
            return [copied(stepped.get(index, scalars.host)) for index, scalars in enumerate(self.scalars)]
        counts: list[dict] = []
        for index, values, state, scalars in self.pending.job.result():
            rest = self.groups[index].split.mask(selected=False)  # the split it was packed under still stands
            assert index == len(counts)  # the worker returns every group, in order
            partitions.setdefault(PENDING_REST, []).append(rest.clone())
            partitions.setdefault(PENDING_VALUES, []).append(unpacked(rest, values))
            for key, value in state.items():
                partitions.setdefault(PENDING_STATE + key, []).append(unpacked(rest, value))
            counts.append(copied(scalars))
        return counts

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s entries; ``"partitions"`` already re-sliced for this rank's partitions."""
        if state.get("format") != STATE_FORMAT or list(state.get("column_widths", ())) != self.widths:
            raise ValueError(
                "zero_optimization.zenflow: the checkpoint's ZenFlow state does not fit this model (format "
                f"{state.get('format')!r}, 2-D weight widths {list(state.get('column_widths', ()))[:8]} vs "
                f"{self.widths[:8]})"
            )
        self._drop_pending()
        self.steps, self.accumulated = int(state["steps"]), int(state["accumulated"])
        self.selected_once, self._select_requested = bool(state["selected_once"]), bool(state["select_requested"])
        self._apply_columns([c.to(torch.bool).clone() for c in state["selected_columns"]])
        parts = state["partitions"]
        for index, group in enumerate(self.groups):
            group.acc = parts[ACCUMULATOR][index].float().clone() if ACCUMULATOR in parts else None
        self.scalars = [PathScalars(copied(s["selected"]), copied(s["host"])) for s in state["step_counts"]]
        if self.auto is not None:
            self.auto.load_state_dict(state.get("auto_interval"))
        self.pending = restored_pending(parts, state.get("pending_host_step_counts"))
        self.host_updates, self.selections = int(state["host_updates"]), int(state["selections"])

    def start_fresh(self) -> None:
        """Start the schedule anew on the inner optimizer's current (e.g. just loaded) state: nothing accumulated
        or in flight, columns selected at the next step, both paths counting on from the optimizer's step count."""
        self._drop_pending()
        for group in self.groups:
            group.acc = None
        self._apply_columns([])
        self.steps = self.accumulated = 0
        self.selected_once = self._select_requested = False
        if self.auto is not None:
            self.auto.reset()
        for index, scalars in enumerate(self.scalars):
            master = self.optimizer.param_groups[index]["params"][0]
            state = self.optimizer.state.get(master, {})
            loaded = {k: v for k, v in state.items() if not _per_element(v, master.numel())}
            scalars.selected, scalars.host = copied(loaded), copied(loaded)

    def _drop_pending(self) -> None:
        """Forget a host update in flight (after waiting for it and for the accumulation: their errors surface,
        and the worker is idle)."""
        self.finish_accumulating()
        pending, self.pending = self.pending, None
        if pending is not None and pending.job is not None:  # one never started is simply dropped
            pending.job.result()

    def shutdown(self) -> None:
        """Finish a pending host update, bring the device columns home and stop the worker."""
        self.finish_accumulating()
        self.settle()
        self.sync_columns(drop=True)
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


def _per_element(value: Any, numel: int) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == numel


def _step_packed(
    optimizer: torch.optim.Optimizer, index: int, values: torch.Tensor, state: dict, scalars: dict, grad: torch.Tensor
) -> tuple[torch.Tensor, dict, dict]:
    """One optimizer step of a packed parameter: returns its new values, per-element state and scalars. With no
    scalars yet the optimizer creates the state afresh (zero moments), as on its first step."""
    group = optimizer.param_groups[index]
    view = torch.nn.Parameter(values, requires_grad=False)
    if scalars:
        optimizer.state[view] = {**state, **copied(scalars)}
    saved = group["params"]
    try:
        view.grad = grad
        group["params"] = [view]
        optimizer.step()
        new = optimizer.state.pop(view, {})
    finally:
        view.grad = None
        group["params"] = saved
        optimizer.state.pop(view, None)
    numel = values.numel()
    per_element = {k: v for k, v in new.items() if _per_element(v, numel)}
    return view.data, per_element, {k: v for k, v in new.items() if k not in per_element}
