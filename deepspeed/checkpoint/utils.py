"""Checkpoint helpers at upstream's import path (``deepspeed.checkpoint.utils``)."""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device = torch.device("cpu")) -> Any:
    """Return ``item`` with every tensor replaced by a detached, compact copy on ``device``.

    ``torch.save`` writes a tensor's whole underlying storage, so a parameter that is a view into a
    large flat buffer would drag the entire buffer into the file. Copying first keeps each saved
    tensor exactly its own size. Lists, tuples and dicts (including ``OrderedDict``) are walked
    recursively and keep their type; any other value is returned unchanged.

    Args:
        item: a tensor, or a (nested) container of tensors and other values.
        device: where the copies live (CPU by default).
    """
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        copy: Any = type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
        # Module state dicts carry per-module version info here; loading old layouts depends on it.
        if hasattr(item, "_metadata"):
            copy._metadata = item._metadata
        return copy
    return item
