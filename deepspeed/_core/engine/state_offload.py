"""Move optimizer state and fp32 masters off the accelerator between phases (``offload_states``).

RL loops alternate training with generation; parking the optimizer's tensors in host memory during
generation frees most of a ZeRO rank's model-state memory. Tensors keep their identity (only ``.data``
moves), so optimizer and hook references stay valid across an offload/reload cycle.

Under ZeRO-3, ``lp_params`` also parks the 16-bit parameter shards: the manager first returns every parameter,
persistent ones included, to the partitioned state (:meth:`ZeroParamManager.shards_for_offload`), so nothing
gathered stays on the device; after the reload the persistent ones are gathered again. ZeRO-3 gradients live
only between a backward and its step, so between steps there are none to move.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from deepspeed._core.comm.page_locked import page_locked_like, unlock_pages
from deepspeed.accelerator import get_accelerator


class StateKind(str, enum.Enum):
    """What ``offload_states(include=...)`` can move (upstream ``OffloadStateTypeEnum`` values)."""

    OPTIM_STATES = "optim_states"
    HP_PARAMS = "hp_params"
    LP_PARAMS = "lp_params"


def _tensors(inner: torch.optim.Optimizer, kinds: set[StateKind]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for group in inner.param_groups:
        for p in group["params"]:
            if StateKind.HP_PARAMS in kinds:
                found.append(p)
            if StateKind.OPTIM_STATES in kinds:
                found.extend(v for v in inner.state.get(p, {}).values() if torch.is_tensor(v) and v.dim() > 0)
    return found


class StateOffloader:
    """Remembers where each moved tensor came from so :meth:`reload` can put it back."""

    def __init__(self) -> None:
        self.moved: list[tuple[torch.Tensor, torch.device]] = []
        self.locked: list[torch.Tensor] = []  # page-locked host copies, unregistered after the reload
        self.manager: Any = None  # the ZeRO-3 parameter manager whose shards are parked, if any

    def offload(
        self,
        inner: torch.optim.Optimizer,
        kinds: set[StateKind],
        device: torch.device,
        pin: torch.dtype | None,
        non_blocking: bool,
        manager: Any = None,
    ) -> None:
        """Move the selected tensors to ``device``; ``pin`` non-None pins host copies.

        ``manager``: the ZeRO-3 parameter manager, needed for ``lp_params`` (refused without one).
        """
        tensors = _tensors(inner, kinds)
        if StateKind.LP_PARAMS in kinds:
            if manager is None:
                raise ValueError("offload_states include='lp_params' is supported with ZeRO stage 3 only")
            tensors += manager.shards_for_offload()
            self.manager = manager
        lock = pin is not None and device.type == "cpu" and get_accelerator().device_name() != "cpu"
        for t in tensors:
            if t.device == device:
                continue
            self.moved.append((t, t.device))
            if lock:
                # One page-locked copy at the tensor's own size ([Note: exact page-locking]); a pinned copy through
                # the caching host allocator would round each flat buffer up to a power of two and keep it cached
                # after the reload.
                host = page_locked_like(t.data)
                host.copy_(t.data, non_blocking=non_blocking)
                self.locked.append(host)
            else:
                host = t.data.to(device, non_blocking=non_blocking)
            t.data = host

    def reload(self, non_blocking: bool) -> None:
        """Move every offloaded tensor back to where it was."""
        for t, device in self.moved:
            t.data = t.data.to(device, non_blocking=non_blocking)
        self.moved.clear()
        if non_blocking:
            get_accelerator().synchronize()
        for host in self.locked:  # every copy up has finished reading it
            unlock_pages(host)
        self.locked.clear()
        if self.manager is not None:
            self.manager.restore_persistent()
            self.manager = None


def parse_kinds(include: Any, zero3: bool = False) -> set[StateKind]:
    """``None`` = everything supported (``lp_params`` with ZeRO-3 only); else names or enum values, validated."""
    if include is None:
        return set(StateKind) if zero3 else {StateKind.OPTIM_STATES, StateKind.HP_PARAMS}
    kinds = set()
    for item in include:
        value = getattr(item, "value", item)
        try:
            kinds.add(StateKind(value))
        except ValueError as err:
            raise ValueError(
                f"offload_states include={value!r} is not supported; valid: {[k.value for k in StateKind]}"
            ) from err
    return kinds
