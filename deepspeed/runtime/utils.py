"""Helper names that training scripts import from ``deepspeed.runtime.utils`` (upstream path).

Only the helpers scripts and integrations actually use are provided; each is a thin function over
torch, ``deepspeed.comm`` and the accelerator.
"""

from __future__ import annotations

import gc
import math
import os
import random
from collections.abc import Callable, Iterable
from typing import Any

import torch

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils.logging import logger

__all__ = [
    "clip_grad_norm_",
    "copy_to_device",
    "empty_cache",
    "ensure_directory_exists",
    "get_global_norm",
    "is_model_parallel_parameter",
    "move_to_device",
    "noop_decorator",
    "see_memory_usage",
    "set_random_seed",
]


def noop_decorator(func: Callable) -> Callable:
    """Return ``func`` unchanged (stands in for optional decorators such as nvtx ranges)."""
    return func


def ensure_directory_exists(filename: str) -> None:
    """Create the parent directory of ``filename`` if it is missing."""
    os.makedirs(os.path.dirname(filename) or ".", exist_ok=True)


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators."""
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)


def _map_nested(item: Any, leaf: Callable[[Any], Any], matches: Callable[[Any], bool]) -> Any:
    if matches(item):
        return leaf(item)
    if isinstance(item, list):
        return [_map_nested(v, leaf, matches) for v in item]
    if isinstance(item, tuple):
        return tuple(_map_nested(v, leaf, matches) for v in item)
    if isinstance(item, dict):
        return {k: _map_nested(v, leaf, matches) for k, v in item.items()}
    return item


def copy_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool]) -> Any:
    """Copies on ``device`` of the items ``criterion_func`` selects, in (nested) lists, tuples and dicts."""
    return _map_nested(item, lambda t: t.to(device), criterion_func)


def move_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool] | None = None) -> Any:
    """Move tensors, possibly nested in lists, tuples and dicts, to ``device``.

    Without ``criterion_func`` every tensor is copied to ``device`` (the originals are untouched). With
    it, each selected item keeps its identity and has its storage moved (``item.data`` is replaced), as
    upstream does. Non-tensor leaves are returned unchanged.
    """
    if criterion_func is None:
        return _map_nested(item, lambda t: t.to(device), torch.is_tensor)

    def _move(t: torch.Tensor) -> torch.Tensor:
        t.data = t.data.to(device)
        return t

    return _map_nested(item, _move, criterion_func)


def is_model_parallel_parameter(p: torch.Tensor) -> bool:
    """True for tensor-parallel parameters (``model_parallel`` or ``tensor_model_parallel`` attribute set)."""
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


def get_global_norm(norm_list: Iterable[float]) -> float:
    """The 2-norm of a list of norms (``sqrt(sum(n**2))``)."""
    return math.sqrt(sum(float(n) ** 2.0 for n in norm_list))


def _local_norm(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    if math.isinf(norm_type):
        return torch.stack([g.detach().abs().max().float() for g in grads]).max()
    return torch.stack([g.detach().float().norm(norm_type) ** norm_type for g in grads]).sum()


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2, mpu: Any = None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so that their total norm is at most ``max_norm``.

    With ``mpu``, tensor-parallel shards contribute on every model-parallel rank and replicated
    parameters only on model-parallel rank 0, and the norm is combined over the model-parallel group.
    The norm is then averaged over the data-parallel group (a no-op for already-reduced gradients).
    Returns the total norm (a tensor on the gradients' device).
    """
    if torch.is_tensor(parameters):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    device = params[0].grad.device if params else torch.device(get_accelerator().current_device_name())
    if mpu is not None and mpu.get_model_parallel_rank() != 0:
        counted = [p.grad for p in params if is_model_parallel_parameter(p)]
    else:
        counted = [p.grad for p in params]
    total = _local_norm(counted, norm_type, device)
    if mpu is not None:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=mpu.get_model_parallel_group())
    if not math.isinf(norm_type):
        total = total.pow(1.0 / norm_type)
    if dist.is_initialized():
        from deepspeed.utils import groups

        dp_group = groups._get_data_parallel_group()
        total = total / float(dist.get_world_size(group=dp_group))
        dist.all_reduce(total, group=dp_group)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.device))
    return total


def empty_cache() -> None:
    """Return cached, unused accelerator memory to the device."""
    get_accelerator().empty_cache()


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log accelerator memory (allocated / peak / reserved, in GB) and host memory, on rank 0 only.

    Does nothing unless ``force`` is true (upstream's contract: callers gate it with a config flag).
    Resets the peak counters so the next call reports the peak since this one.
    """
    if not force:
        return
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    gc.collect()
    acc = get_accelerator()
    gb = 1024**3
    logger.info(message)
    logger.info(
        f"MA {acc.memory_allocated() / gb:.2f} GB  Max_MA {acc.max_memory_allocated() / gb:.2f} GB  "
        f"CA {acc.memory_reserved() / gb:.2f} GB  Max_CA {acc.max_memory_reserved() / gb:.2f} GB"
    )
    try:
        import psutil

        vm = psutil.virtual_memory()
        logger.info(f"CPU Virtual Memory:  used = {(vm.total - vm.available) / gb:.2f} GB, percent = {vm.percent}%")
    except ImportError:
        logger.info("CPU Virtual Memory: psutil is not installed")
    acc.reset_peak_memory_stats()
