"""Point-to-point transfers of activations and gradients between neighbouring pipeline stages.

A stage's forward output travels to the next stage, and the gradient of that output travels back
([Note: pipeline p2p] in ``docs/design/pipeline_engine.md``). Both ends must allocate receive buffers of the right
shape and dtype, so the first transfer in each direction is preceded by one small metadata message
(:class:`TensorMeta` per tensor, packed into an int64 tensor); both ends cache it and every later micro-batch
reuses it. Gradients need no metadata of their own:
they travel for exactly the sent tensors that require a gradient, with the sent shape and dtype.

Sends are issued asynchronously and waited for at the end of each schedule step (:meth:`StageLink.drain`), so
a schedule whose blocking-send order is deadlock-free stays deadlock-free, and a sent tensor lives at most one
step longer than the stage needs it. Receives block. Every transfer goes through ``deepspeed.comm`` with global
ranks (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed._core.comm import dist

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_META_HEADER = 2  # (number of tensors, packed length)
_META_MAX = 256  # int64 words; enough for a tuple of 16 tensors of rank 8


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and whether the receiver must make the tensor require a gradient."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorMeta:
        """The metadata of ``tensor`` as sent (a gradient flows back only for floating tensors in a graph)."""
        return TensorMeta(tuple(tensor.shape), tensor.dtype, bool(tensor.requires_grad and tensor.is_floating_point()))


@dataclass(frozen=True)
class Payload:
    """What one forward hands to the next stage: one tensor, or a tuple of them (``is_tuple``)."""

    metas: tuple[TensorMeta, ...]
    is_tuple: bool

    @staticmethod
    def of(value: Any) -> Payload:
        """Describe ``value``, a tensor or a tuple/list of tensors; anything else is a clear error."""
        tensors = as_tensors(value)
        return Payload(tuple(TensorMeta.of(t) for t in tensors), not isinstance(value, torch.Tensor))

    def pack(self) -> torch.Tensor:
        """The metadata as one int64 tensor of fixed length (so the receiver can post its receive blindly)."""
        words: list[int] = [int(self.is_tuple)]
        for meta in self.metas:
            words += [_DTYPES.index(meta.dtype), int(meta.requires_grad), len(meta.shape), *meta.shape]
        if len(words) + _META_HEADER > _META_MAX:
            raise ValueError(f"a pipeline stage output with {len(self.metas)} tensors is too large to describe")
        packed = torch.zeros(_META_MAX, dtype=torch.int64)
        packed[0], packed[1] = len(self.metas), len(words)
        packed[_META_HEADER : _META_HEADER + len(words)] = torch.tensor(words, dtype=torch.int64)
        return packed

    @staticmethod
    def unpack(packed: torch.Tensor) -> Payload:
        """Inverse of :meth:`pack`."""
        count, length = int(packed[0]), int(packed[1])
        words = packed[_META_HEADER : _META_HEADER + length].tolist()
        is_tuple, pos, metas = bool(words[0]), 1, []
        for _ in range(count):
            dtype, grad, ndim = _DTYPES[words[pos]], bool(words[pos + 1]), words[pos + 2]
            metas.append(TensorMeta(tuple(words[pos + 3 : pos + 3 + ndim]), dtype, grad))
            pos += 3 + ndim
        return Payload(tuple(metas), is_tuple)


def as_tensors(value: Any) -> tuple[torch.Tensor, ...]:
    """``value`` as a tuple of tensors; a stage output of any other kind cannot cross a stage boundary."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and value and all(isinstance(t, torch.Tensor) for t in value):
        return tuple(value)
    raise TypeError(
        "a pipeline stage must output a tensor or a non-empty tuple of tensors to send to the next stage, got "
        f"{_describe(value)}"
    )


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__


class StageLink:
    """This rank's two links: to the previous stage (``prev_rank``) and to the next one (``next_rank``).

    Args:
        prev_rank: global rank of the previous stage of this replica, or ``None`` on the first stage.
        next_rank: global rank of the next stage, or ``None`` on the last stage.
        device: where receive buffers are allocated (the compute device).
        comm_device: where tensors must be to travel (the backend's device; CPU under gloo).
    """

    def __init__(
        self, prev_rank: int | None, next_rank: int | None, device: torch.device, comm_device: torch.device
    ) -> None:
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.device = device
        self.comm_device = comm_device
        # Metadata of what crosses each boundary, per mode ("train" sends graph tensors, "eval" does not).
        self.sent: dict[str, Payload] = {}
        self.received: dict[str, Payload] = {}
        self._pending: list[tuple[Any, torch.Tensor]] = []

    # --- activations (forward direction) ------------------------------------------------------------------
    def send_activation(self, value: Any, mode: str) -> None:
        """Send a forward output to the next stage (its metadata first, the first time in ``mode``)."""
        payload = Payload.of(value)
        known = self.sent.get(mode)
        if known is None:
            self.sent[mode] = payload
            self._isend(payload.pack(), self.next_rank)
        elif known != payload:
            raise ValueError(
                f"pipeline stage output changed from {known} to {payload}: every micro-batch must produce "
                "the same shapes and dtypes"
            )
        for tensor in as_tensors(value):
            self._isend(tensor.detach(), self.next_rank)

    def recv_activation(self, mode: str) -> Any:
        """Receive the previous stage's output; floating tensors in its graph come back requiring a gradient."""
        payload = self.received.get(mode)
        if payload is None:
            packed = torch.zeros(_META_MAX, dtype=torch.int64, device=self.comm_device)
            dist.recv(packed, src=self.prev_rank)
            payload = self.received[mode] = Payload.unpack(packed.cpu())
        tensors = []
        for meta in payload.metas:
            buf = self._recv(meta.shape, meta.dtype, self.prev_rank)
            tensors.append(buf.requires_grad_(meta.requires_grad))
        return tuple(tensors) if payload.is_tuple else tensors[0]

    # --- gradients (backward direction) -----------------------------------------------------------------------
    def send_grads(self, inputs: Any) -> None:
        """Send the gradients of this stage's received ``inputs`` back (zeros where autograd left none)."""
        for tensor in as_tensors(inputs):
            if not tensor.requires_grad:
                continue
            grad = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
            self._isend(grad, self.prev_rank)

    def recv_grads(self, mode: str = "train") -> list[torch.Tensor | None]:
        """Receive the gradients of the tensors :meth:`send_activation` sent (``None`` for the others)."""
        payload = self.sent[mode]
        return [self._recv(m.shape, m.dtype, self.next_rank) if m.requires_grad else None for m in payload.metas]

    # --- transport ------------------------------------------------------------------------------------------
    def _isend(self, tensor: torch.Tensor, dst: int | None) -> None:
        if dst is None:
            raise RuntimeError("no neighbouring stage to send to (schedule and stage disagree)")
        wire = tensor.to(self.comm_device) if tensor.device != self.comm_device else tensor
        wire = wire.contiguous()
        # The tensor is held until the send completes: the backend may still be reading it.
        self._pending.append((dist.isend(wire, dst=dst), wire))

    def _recv(self, shape: Sequence[int], dtype: torch.dtype, src: int | None) -> torch.Tensor:
        if src is None:
            raise RuntimeError("no neighbouring stage to receive from (schedule and stage disagree)")
        wire = torch.empty(tuple(shape), dtype=dtype, device=self.comm_device)
        dist.recv(wire, src=src)
        return wire.to(self.device) if self.device != self.comm_device else wire

    def drain(self) -> None:
        """Wait for every send issued so far and drop the references that kept the sent tensors alive."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def pending_sends(self) -> int:
        """Sends issued and not yet drained (tests check that a step ends with none)."""
        return len(self._pending)
