"""``category_hints`` for a snapshot: device addresses of the model state, taken when the snapshot is recorded.

Blocks allocated before recording started carry no stack; these addresses let the analysis place them. The
functions are duck-typed (no torch import), so benchmark workers can use them on any model and optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .rules import BUFFERS, GRADS, OPTIM, PARAMS


def _tensor_span(t: Any) -> tuple[int, int] | None:
    t = getattr(t, "_local_tensor", t)  # a DTensor (FSDP2) owns its storage through its local shard
    if not hasattr(t, "data_ptr") or not hasattr(t, "element_size") or getattr(t, "device", None) is None:
        return None
    if t.device.type in ("cpu", "meta") or t.numel() == 0:
        return None
    return int(t.data_ptr()), int(t.numel() * t.element_size())


def _grad_of(t: Any) -> Any:
    # A non-leaf tensor (e.g. a DTensor's local view) has no .grad of its own; reading it only raises a warning.
    return getattr(t, "grad", None) if getattr(t, "is_leaf", True) else None


def tensor_hints(module: Any, optimizer: Any = None) -> list[dict[str, Any]]:
    """``category_hints`` for a snapshot: the device addresses of ``module``'s parameters (and ZeRO-3
    ``ds_tensor`` shards), their gradients, its buffers, and ``optimizer``'s master weights and state.

    Blocks allocated before recording started carry no stack; these addresses let the summary place them.
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
        # A shard that is a view of the fp32 master is the optimizer's memory, labelled with the master below.
        if not getattr(p.__dict__.get("_ds_state"), "shard_is_master", False):
            add(getattr(p, "ds_tensor", None), PARAMS)
        add(_grad_of(p), GRADS)
    for b in module.buffers() if module is not None else ():
        add(b, BUFFERS)
    inner = getattr(optimizer, "optimizer", optimizer)
    for group in getattr(inner, "param_groups", None) or ():
        for p in group.get("params", ()):
            add(p, OPTIM)  # master weights (working parameters were added above and win)
            add(_grad_of(p), GRADS)
    for state in (getattr(inner, "state", None) or {}).values():
        for value in state.values() if isinstance(state, Mapping) else ():
            add(value, OPTIM)
    return list(hints.values())
