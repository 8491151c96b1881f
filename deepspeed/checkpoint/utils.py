"""Checkpoint helpers at upstream's import path (``deepspeed.checkpoint.utils``)."""

from __future__ import annotations

import os
from typing import Any

import torch

from deepspeed.checkpoint.constants import (
    MODEL_FILE_PREFIX,
    MODEL_FILE_SUFFIX,
    OPTIM_FILE_SUFFIX,
    ZERO_FILE_PREFIX,
)


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """Path of the model-states file of model-parallel rank ``mp_rank_str`` (already formatted, e.g. ``"00"``)."""
    return os.path.join(base_folder, f"{MODEL_FILE_PREFIX}{mp_rank_str}{MODEL_FILE_SUFFIX}")


def get_zero_ckpt_name_for_rank(base_folder: str, dp_rank: int, mp_rank: int) -> str:
    """Path of the ZeRO optimizer-states file of data-parallel rank ``dp_rank`` and model-parallel rank ``mp_rank``."""
    name = f"{ZERO_FILE_PREFIX}{dp_rank}_{MODEL_FILE_PREFIX}{mp_rank:02d}{OPTIM_FILE_SUFFIX}"
    return os.path.join(base_folder, name)


def get_layer_ckpt_name_for_rank(base_folder: str, layer_id: str, tp_rank: int) -> str:
    """Path of a pipeline layer's file: ``layer_id`` is the layer's file stem (``layer_03``), ``tp_rank`` the
    tensor-parallel rank."""
    return os.path.join(base_folder, f"{layer_id}-model_{tp_rank:02d}{MODEL_FILE_SUFFIX}")


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
