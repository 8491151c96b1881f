"""Step an fp32 master partition whose gradient is kept in a narrower dtype, one chunk at a time.

[Note: chunked step] Inner optimizers want an fp32 gradient shaped like the fp32 master. Converting a
bf16/fp16 partition gradient in one go materialises a second, fp32 copy of the whole gradient partition
at the step (4 bytes per partition element on top of the floor; measured on the H200, docs/benchmarks.md).
Instead the master is stepped through views of ``chunk_numel`` elements: each view is handed to the
optimizer as a temporary parameter whose state entries are views of the master's state, with an fp32
copy of just that chunk of the gradient. In-place optimizers (Adam/AdamW/Adagrad/Lion/SGD, torch's and
ours) then update the master's state directly; state an optimizer creates lazily on its first step is
copied into master-shaped tensors once. Peak extra memory: one chunk of fp32 gradient.

[Note: scaled step] An optimizer with ``step_scaled(grad, scale, copy_out)`` (the host Adam kernel,
``DeepSpeedCPUAdam``) takes a range's gradient in its own dtype and scales it as it loads it, and writes the
updated values rounded to the working dtype in the same pass: the conversion into the fp32 buffer, the scaling
pass and the later read of the master for the copy up are three passes over host memory it saves, and an
offloaded step is bound by memory bandwidth. With an fp32 master, the same bits as the general route, which
every other optimizer takes (``step_scaled`` returns ``False`` where the kernel cannot, and the range is then
converted as above). With a bf16 master and bf16 moments (16-bit offloaded states), the fp32 computation on the
same values, each result rounded once; the gradient is scaled in fp32 where the general route would round the
scaled gradient to bf16 first.
"""

from __future__ import annotations

from typing import Any

import torch

# CONVERT_BLOCK_NUMEL is re-exported: it was defined here before the conversion moved to the gradient room.
from deepspeed._core.grads.convert import CONVERT_BLOCK_NUMEL as CONVERT_BLOCK_NUMEL
from deepspeed._core.grads.convert import Coef, convert_scaled, scales

STEP_CHUNK_BYTES_CAP = 1 << 28
"""At most 256 MiB of fp32 gradient per chunk: large enough that per-chunk launches are noise (a 1.4B
model steps in ~6 chunks), small enough to stay a small transient beside the master."""
STEP_CHUNK_BYTES_MIN = 1 << 26
"""At least 64 MiB per chunk: smaller chunks would step a 3B model in ~1,500 optimizer calls, each paying Python
overhead. A master offloaded to the host steps in chunks of this size (its step is bound by its arithmetic, not
by the number of calls)."""
STEP_CHUNKS_PER_MASTER = 16
"""A master on the accelerator is stepped in about this many chunks when that needs chunks above the minimum (up
to the cap): every chunk is one optimizer call whose host time (~0.1-0.2 ms) the device waits for when the step
is host-bound, and with 64 MiB chunks a 3B master at one rank took ~180 calls. A sixteenth of the master in
fp32 is at most a quarter of a byte per parameter of transient, against the 12-16 of the state itself."""


def step_chunk_numel(master_dtype: torch.dtype, master_numel: int = 0) -> int:
    """Elements per step chunk: a :data:`STEP_CHUNKS_PER_MASTER`-th of the largest master (``master_numel``
    elements; 0 for a master offloaded to the host), clamped to [64 MiB, 256 MiB] of master dtype and rounded down
    to a power of two, so page-locked chunks of this many elements (offloaded gradient shards) are not rounded up
    by the caching host allocator ([Note: pinned ring]). The step's own rule: gradient bucket sizes
    (``reduce_bucket_size``) size the reducer's buckets only."""
    master_bytes = torch.empty((), dtype=master_dtype).element_size()
    wanted = master_numel * master_bytes // STEP_CHUNKS_PER_MASTER
    clamped = max(1, min(max(wanted, STEP_CHUNK_BYTES_MIN), STEP_CHUNK_BYTES_CAP))
    return max(1, (1 << (clamped.bit_length() - 1)) // master_bytes)


def chunk_ranges(numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of ``chunk_numel`` elements (the last one shorter) that cover ``numel``."""
    step = max(1, chunk_numel)
    return [(a, min(a + step, numel)) for a in range(0, numel, step)]


def _is_per_element(value: Any, numel: int) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == numel


def _chunk_state(master_state: dict, scalars: dict, start: int, end: int) -> dict[str, Any]:
    """Views of the master's per-element state for ``[start, end)`` plus fresh copies of the scalars
    (e.g. the step count) as they were before this update, so every view advances them exactly once."""
    state = {k: v[start:end] for k, v in master_state.items() if k not in scalars}
    state.update({k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()})
    return state


def _merge_back(master_state: dict, chunk_state: dict, master: torch.Tensor, start: int, end: int) -> dict:
    """Fold a view's per-element state into the master's; returns the view's scalars (same for every view)."""
    scalars = {}
    for key, value in chunk_state.items():
        if _is_per_element(value, end - start):
            if key not in master_state:  # created lazily by the optimizer on its first step
                master_state[key] = torch.zeros(master.numel(), dtype=value.dtype, device=value.device)
            target = master_state[key][start:end]
            if target.data_ptr() != value.data_ptr():
                target.copy_(value)
        else:
            scalars[key] = value
    return scalars


class ChunkStepper:
    """One update of the single master parameter of ``optimizer.param_groups[group_index]``, cut into ranges of
    ``chunk_numel`` elements that are stepped one call at a time (:meth:`step_range`), each exactly once and in
    any order, then closed (:meth:`close`).

    Every range gets the same treatment as in one :func:`step_in_chunks` call, so how the ranges are spread over
    time (one loop, or a host worker that steps each range as soon as its gradient has landed, [Note: overlapped
    host step]) does not change a bit of the result. While open, the master's state is held here, not in
    ``optimizer.state``; only one range of a group may step at a time.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, group_index: int, chunk_numel: int) -> None:
        self.optimizer, self.group_index = optimizer, group_index
        self.chunk_numel = max(1, chunk_numel)
        self.group = optimizer.param_groups[group_index]
        (self.master,) = self.group["params"]
        self.master_state = optimizer.state.pop(self.master, {})
        # Decided once: on the very first update every chunk lets the optimizer create its state (and its
        # step count) afresh; chunk views must not pick up counters an earlier chunk already advanced.
        self.existing = bool(self.master_state)
        numel = self.master.numel()
        self.scalars = {k: v for k, v in self.master_state.items() if not _is_per_element(v, numel)}
        self.updated: dict = {}
        # One conversion buffer for every chunk. A fresh host tensor per chunk is page-faulted in (zeroed by the
        # kernel) on first touch: on the 2-core development CPU the bf16->fp32 conversion of 128M elements took
        # 0.44 s that way and 0.09 s through one reused buffer (benchmarks/offload_step_cpu.py, cpu/README.md).
        self.convert: torch.Tensor | None = None
        self.closed = False

    def ranges(self) -> list[tuple[int, int]]:
        """The ``[start, end)`` ranges of the master, in order."""
        return chunk_ranges(self.master.numel(), self.chunk_numel)

    def _buffer(self) -> torch.Tensor:
        if self.convert is None:
            width = min(self.chunk_numel, self.master.numel())
            self.convert = torch.empty(width, dtype=self.master.dtype, device=self.master.device)
        return self.convert

    def _grad_of(self, grad: Any, start: int, end: int, coef: Coef, consume: bool) -> torch.Tensor:
        """The master-dtype gradient of ``[start, end)`` scaled by ``coef`` (see :func:`step_in_chunks`)."""
        master = self.master
        # A gradient that assembles ranges itself (parked gradients) converts each piece from where it lies.
        if hasattr(grad, "convert_into"):
            out = self._buffer()[: end - start]
            if grad.convert_into(start, end, out, coef):
                return out
        piece = grad.window(start, end) if hasattr(grad, "window") else grad[start:end]
        if consume and piece.dtype == master.dtype and piece.device == master.device:
            if scales(coef):
                piece.mul_(coef)
            return piece
        out = self._buffer()[: end - start]
        convert_scaled(out, piece, coef)
        return out

    def step_range(
        self,
        start: int,
        end: int,
        grad: Any,
        coef: Coef = 1.0,
        consume: bool = False,
        copy_out: torch.Tensor | None = None,
    ) -> None:
        """Apply the update to ``[start, end)`` (one of :meth:`ranges`) with that range of ``grad``; with
        ``copy_out`` (``end - start`` elements), also write the updated values into it, in its dtype."""
        optimizer, group, master = self.optimizer, self.group, self.master
        view = torch.nn.Parameter(master.data[start:end], requires_grad=False)
        if self.existing:
            optimizer.state[view] = _chunk_state(self.master_state, self.scalars, start, end)
        try:
            group["params"] = [view]
            if not self._step_scaled(view, start, end, grad, coef, copy_out):
                view.grad = self._grad_of(grad, start, end, coef, consume)
                optimizer.step()
                if copy_out is not None:
                    copy_out.copy_(view.data)
            self.updated = _merge_back(self.master_state, optimizer.state.pop(view, {}), master.data, start, end)
        finally:
            view.grad = None
            group["params"] = [master]
            optimizer.state.pop(view, None)
        if consume and hasattr(grad, "release"):
            grad.release(start, end)  # stepped: its memory can serve the next chunk

    def _step_scaled(
        self, view: torch.nn.Parameter, start: int, end: int, grad: Any, coef: Coef, copy_out: torch.Tensor | None
    ) -> bool:
        """The range through the optimizer's one-pass form ([Note: scaled step]); ``False`` when it has none or
        cannot take this range (the caller then converts)."""
        step_scaled = getattr(self.optimizer, "step_scaled", None)
        if step_scaled is None or torch.is_tensor(coef) or view.device.type != "cpu":
            return False
        piece = grad.window(start, end) if hasattr(grad, "window") else grad[start:end]
        if piece.device.type != "cpu":
            return False
        return bool(step_scaled(piece, float(coef), copy_out))

    def close(self) -> None:
        """End the update: the master's state (with the advanced scalars) goes back to the optimizer."""
        if self.closed:
            return
        self.closed = True
        self.master_state.update(self.updated)
        self.group["params"] = [self.master]
        self.optimizer.state[self.master] = self.master_state
        self.convert = None


def step_in_chunks(
    optimizer: torch.optim.Optimizer,
    group_index: int,
    grad: Any,
    chunk_numel: int,
    coef: Coef = 1.0,
    consume: bool = False,
) -> None:
    """Apply one update to the single master parameter of ``optimizer.param_groups[group_index]``.

    ``grad`` (any float dtype, same numel as the master; a tensor, or an object whose ``window(start, end)``
    returns that range, such as :class:`~deepspeed._core.grads.accumulator.ChunkedGradShard`, or whose
    ``convert_into(start, end, out, coef)`` writes it already converted and scaled) is converted to
    the master's dtype and device ``chunk_numel`` elements at a time and multiplied by ``coef`` (unscale and
    clip) after conversion, so an fp16 gradient is never divided in fp16. With ``consume`` the caller gives
    the gradient up: a range already in the master's dtype and device is scaled in place and used without a
    copy, and a ``grad`` with ``release(start, end)`` is told when each range has been stepped. No other
    parameter may hold a gradient during the call.
    """
    stepper = ChunkStepper(optimizer, group_index, chunk_numel)
    try:
        for start, end in stepper.ranges():
            stepper.step_range(start, end, grad, coef, consume)
    finally:
        stepper.close()
