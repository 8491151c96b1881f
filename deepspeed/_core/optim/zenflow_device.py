"""ZenFlow's every-step path stepped where the working weights live.

[Note: zenflow columns] With the every-step path on the host, each step gathers the selected elements of the master
and both moments out of the partition and scatters them back, and gathering a tenth of a weight's columns touches
most of its cache lines: the host does about as much work per step as the plain offloaded update
([Note: zenflow split]). So once columns are selected (and the optimizer is the host Adam with fp32 states), the
selected elements' master and moments are kept packed beside the working weights (:class:`DeviceColumns`, 12 bytes
per selected element) and stepped there with the same rule; the host adds the rest of the gradient into its
accumulator, and the new values go into the working weights by the split's indices without crossing back. The
selected gradient is gathered on the device as the backward delivers each reduced piece (:class:`ColumnGradGather`,
one more packed buffer in the partition gradient's dtype); where that cannot stand for the window's gradient (the
step of a selection, a gradient written on the host), the host packs it and :class:`ColumnGradUpload` sends it in
its own dtype, converted and scaled on arrival. The host copies of those elements are stale meanwhile:
:meth:`~deepspeed._core.optim.zenflow.ZenFlowUpdate.sync_columns` writes them back before anything reads the whole
master (a full publish, a new selection, a checkpoint, the ``safe_get_*`` helpers) and drops the columns when the
host copy is replaced (a load, ``safe_set_*``). The arithmetic is the host kernel's, in the same order, on fp32; an
accelerator may still round a fused multiply-add differently, so the two are close, not bit-equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed._core.comm.page_locked import locked_empty
from deepspeed._core.comm.streams import record_current
from deepspeed._core.grads.convert import Coef, scales
from deepspeed._core.optim.zenflow_split import ColumnSplit


@dataclass(frozen=True)
class AdamRule:
    """How weight decay enters the update: ``decoupled`` (AdamW) scales the master, else (Adam with L2) it is
    added to the gradient."""

    decoupled: bool


def adam_rule_of(optimizer: torch.optim.Optimizer) -> AdamRule | None:
    """The rule of a host Adam with fp32 states (``DeepSpeedCPUAdam``'s policy), which the columns can step the
    same way; ``None`` for any other optimizer (its every-step path stays on the host)."""
    policy = getattr(optimizer, "policy", None)
    mode = getattr(policy, "mode", None)
    if mode is None or not getattr(policy, "fp32_optimizer_states", False):
        return None
    return AdamRule(decoupled=mode.name == "DECOUPLED")


@dataclass
class DeviceColumns:
    """One group's every-step path, packed in the split's order, on the working weights' device."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int

    def step_(self, grad: torch.Tensor, group: dict, rule: AdamRule) -> None:
        """One Adam step with ``grad`` (packed, fp32, on this device) and ``group``'s hyperparameters."""
        self.step += 1
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        corrected = group.get("bias_correction", True)
        bias1 = 1.0 - beta1**self.step if corrected else 1.0
        bias2 = 1.0 - beta2**self.step if corrected else 1.0
        if decay and not rule.decoupled:
            grad = grad.add(self.master, alpha=decay)
        self.exp_avg.lerp_(grad, 1.0 - beta1)  # m + (1 - b1)(g - m), or g - b1 (g - m) for b1 < 0.5, as the kernel
        self.exp_avg_sq.mul_(beta2).add_(grad * grad, alpha=1.0 - beta2)
        denom = self.exp_avg_sq.sqrt().div_(math.sqrt(bias2)).add_(eps)
        if decay and rule.decoupled:
            self.master.mul_(1.0 - lr * decay)
        self.master.add_(self.exp_avg / denom, alpha=-lr / bias1)


class ColumnGradUpload:
    """One group's selected gradient on its way to the device columns.

    It is packed on the host in the gradient's own dtype into one buffer kept while the columns stand
    (page-locked when ``device`` is an accelerator), sent without blocking, and converted to fp32 and scaled by
    the step's coefficient on arrival: the same elementwise operations the host would run, on half the bytes for
    a 16-bit gradient. The buffer is packed again only once the event recorded after its last copy has passed.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._staging: torch.Tensor | None = None
        self._sent: Any = None  # the event after the last copy out of the staging buffer

    def send(self, split: ColumnSplit, raw: torch.Tensor, coef: Coef) -> torch.Tensor:
        """``raw``'s selected elements on ``device``, in fp32, scaled by ``coef``."""
        numel = split.counts[0]
        self.wait()
        if self._staging is None or self._staging.numel() != numel or self._staging.dtype != raw.dtype:
            pinned = self.device.type != "cpu"
            self._staging = locked_empty(numel, raw.dtype) if pinned else torch.empty(numel, dtype=raw.dtype)
        split.take(raw, True, out=self._staging)
        grad = self._staging.to(self.device, non_blocking=True)
        self._sent = record_current()
        return scaled_fp32(grad, coef)

    def wait(self) -> None:
        """Until the last copy out of the staging buffer has left (before it is packed again or dropped)."""
        sent, self._sent = self._sent, None
        if sent is not None:
            sent.synchronize()


class ColumnGradGather:
    """The selected gradient gathered where the columns are stepped, as the backward delivers it.

    Each piece of a reduced gradient on its way into the partition gradient (``PartitionGrads.sunk``) gives up its
    selected elements here, by the split of the piece's window of the partition, into one packed buffer per group
    in the partition gradient's dtype: added like the host adds them (stage 2, zeroed at the window's start) or
    copied (stage 1, one delivery per window). At the step the buffer holds exactly the host's
    ``take(partition gradient)``, with no gather on the host and nothing sent up. It is used only when it was
    gathered over the whole window under the split in force at the step; anything else (a new selection, a
    window that began before the columns existed, a gradient written on the host) falls back to
    :class:`ColumnGradUpload`.
    """

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}
        self.splits: dict[int, ColumnSplit] = {}  # per group: the split the buffer was gathered under
        self.open = False  # gathering this window, from its first micro-step

    def begin(self, splits: dict[int, ColumnSplit]) -> None:
        """A window's first micro-step starts: gather from here on under ``splits``, into zeroed buffers."""
        self.open, self.splits = True, dict(splits)
        for buf in self.buffers.values():
            buf.zero_()

    def land(self, index: int, numel: int, dtype: torch.dtype, offset: int, taken: torch.Tensor, adds: bool) -> None:
        """Put ``taken`` (selected elements of one piece) at ``offset`` of group ``index``'s buffer of ``numel``
        elements of ``dtype`` (zeros when new or resized)."""
        buf = self.buffers.get(index)
        if buf is None or buf.numel() != numel or buf.dtype != dtype or buf.device != taken.device:
            buf = self.buffers[index] = torch.zeros(numel, dtype=dtype, device=taken.device)
        window = buf[offset : offset + taken.numel()]
        if adds:
            window.add_(taken)
        else:
            window.copy_(taken)

    def take(self, index: int, split: ColumnSplit) -> torch.Tensor | None:
        """Group ``index``'s gathered gradient if it covers this window under ``split``, else ``None``."""
        buf = self.buffers.get(index)
        if not self.open or self.splits.get(index) is not split or buf is None or buf.numel() != split.counts[0]:
            return None  # (a buffer of another size: no piece with selected elements landed since the split)
        return buf

    def close(self) -> None:
        """The window ended (its step ran, or its gradients were dropped or written elsewhere)."""
        self.open = False


def scaled_fp32(grad: torch.Tensor, coef: Coef) -> torch.Tensor:
    """``grad`` in fp32 times ``coef`` (the host's conversion, then its product in fp32), never in place: ``grad``
    may be a buffer that is read again."""
    grad = grad.float()
    return grad * coef if scales(coef) else grad
