"""Read and write a model parameter's high-precision values, optimizer state and gradient.

Upstream names (``deepspeed.utils.safe_get_full_fp32_param`` and friends). Which optimizer manages a
parameter decides where the values live:

- ZeRO-3 parameters (they carry ``ds_id``) are answered by ``param._z3_optimizer``; without one (an
  inference-only ZeRO-3 model) the getters return ``None``.
- ZeRO-1/2 and stage-0 parameters carry ``param._hp_mapping``
  (:mod:`deepspeed._core.optim.hp_mapping`). For ZeRO-1/2 the *full* getters are collectives: every
  rank of the data-parallel group must call them for the same parameter, in the same order.
- Any other parameter is not managed: getters return ``None`` and setters do nothing.

Return values are fp32 tensors of the parameter's shape on the parameter's device. ``safe_get_full_grad``
returns ``param.grad`` itself when autograd's gradient still exists; the lean ZeRO-1/2 paths free it at
once, and then the gradient is assembled from the partition gradients, which exist only between a
backward and the optimizer step (asking outside that window raises ``ValueError``; see the module
docstring of ``param_mapping`` for the exact contents).

The ``safe_*_local_*`` helpers are defined for ZeRO-3 parameters only, as upstream: passing any other
parameter fails an assertion.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepspeed._core.optim.stage12_state import fragment_address  # noqa: F401 - upstream public name

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]

_LOCAL_ONLY_Z3 = "the safe_*_local_* helpers are defined for ZeRO-3 partitioned parameters only"


# _z3 and _mapping return duck-typed objects (the ZeRO-3 optimizer, a stage-1/2 fragment mapping) or None; this
# façade only calls their upstream-named methods, so Any says no more than it knows.
def _z3(param: torch.nn.Parameter) -> Any:
    """The ZeRO-3 optimizer managing ``param`` (None when it is not a ZeRO-3 parameter or has none)."""
    return getattr(param, "_z3_optimizer", None) if hasattr(param, "ds_id") else None


def _mapping(param: torch.nn.Parameter) -> Any:
    """The live ``_hp_mapping`` of ``param`` (None when unmanaged or its optimizer has been released)."""
    mapping = getattr(param, "_hp_mapping", None)
    return mapping if mapping is not None and getattr(mapping, "alive", True) else None


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The whole fp32 (master) value of ``param``, or ``None`` when no optimizer manages it."""
    if hasattr(param, "ds_id"):
        z3 = _z3(param)
        return None if z3 is None else z3.get_full_hp_param(param)
    mapping = _mapping(param)
    return None if mapping is None else mapping.get_full_hp_param()


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite the fp32 (master) value of ``param`` with ``value`` (the whole parameter)."""
    if hasattr(param, "ds_id"):
        z3 = _z3(param)
        if z3 is not None:
            z3.set_full_hp_param(value, param)
        return
    mapping = _mapping(param)
    if mapping is not None:
        mapping.set_full_hp_param(value)


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The whole fp32 optimizer state ``optim_state_key`` (e.g. ``"exp_avg"``) of ``param``, or ``None``."""
    if hasattr(param, "ds_id"):
        z3 = _z3(param)
        return None if z3 is None else z3.get_full_hp_param(param, optim_state_key)
    mapping = _mapping(param)
    return None if mapping is None else mapping.get_full_hp_param(optim_state_key)


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Overwrite the optimizer state ``optim_state_key`` of ``param`` with ``value`` (whole-parameter shape)."""
    if hasattr(param, "ds_id"):
        z3 = _z3(param)
        if z3 is not None:
            z3.set_full_hp_param(value, param, optim_state_key)
        return
    mapping = _mapping(param)
    if mapping is not None:
        mapping.set_full_hp_param(value, optim_state_key)


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The whole gradient of ``param``: ``param.grad`` when set, else assembled from the partition gradients."""
    if param.grad is not None:
        return param.grad
    if hasattr(param, "ds_id"):
        z3 = _z3(param)
        return None if z3 is None else z3.get_fp32_grad_for_param(param)
    mapping = _mapping(param)
    return None if mapping is None else mapping.get_full_hp_grad()


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite the gradient of ``param`` (``param.grad`` when set, else this rank's partition fragment)."""
    if param.grad is not None:
        param.grad.copy_(value)
    elif hasattr(param, "ds_id"):
        z3 = _z3(param)
        if z3 is not None:
            z3.set_fp32_grad_for_param(value, param)
    elif _mapping(param) is not None:
        _mapping(param).set_full_hp_grad(value)


def _local_z3(param: torch.nn.Parameter) -> Any:
    assert hasattr(param, "ds_id"), _LOCAL_ONLY_Z3
    return _z3(param)


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's partition of the gradient of a ZeRO-3 parameter."""
    z3 = _local_z3(param)
    return None if z3 is None else z3.get_local_fp32_grad_for_param(param)


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite this rank's partition of the gradient of a ZeRO-3 parameter."""
    z3 = _local_z3(param)
    if z3 is not None:
        z3.set_local_grad_for_param(value, param)


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's fp32 partition of a ZeRO-3 parameter."""
    z3 = _local_z3(param)
    return None if z3 is None else z3.get_local_fp32_param(param)


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """This rank's partition of optimizer state ``optim_state_key`` of a ZeRO-3 parameter."""
    z3 = _local_z3(param)
    return None if z3 is None else z3.get_local_fp32_param(param, optim_state_key)


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Overwrite this rank's partition of optimizer state ``optim_state_key`` of a ZeRO-3 parameter."""
    z3 = _local_z3(param)
    if z3 is not None:
        z3.set_local_hp_param(value, param, optim_state_key)


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite this rank's fp32 partition of a ZeRO-3 parameter."""
    z3 = _local_z3(param)
    if z3 is not None:
        z3.set_local_hp_param(value, param)


def safe_update_full_grad_vectorized(
    param_list: list[torch.nn.Parameter],
    update_func: Callable[[torch.Tensor, torch.nn.Parameter], torch.Tensor],
) -> None:
    """Replace each parameter's gradient ``g`` by ``update_func(g, param)``.

    Parameters whose ``.grad`` exists are updated in place; the others (trainable ones only) go through
    their optimizer. ZeRO-1/2 reads are collective, so every rank must pass the same list.
    """
    pending = []
    for p in param_list:
        if p.grad is not None:
            p.grad.copy_(update_func(p.grad, p))
        elif p.requires_grad:
            pending.append(p)
    if not pending:
        return
    z3 = _z3(pending[0])
    if z3 is not None:
        z3.update_fp32_grad_for_param_vectorized(update_func, pending)
        return
    for p in pending:
        mapping = _mapping(p)
        if mapping is not None:
            mapping.set_full_hp_grad(update_func(mapping.get_full_hp_grad(), p))
