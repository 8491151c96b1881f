"""From a model parameter to its high-precision (fp32) values, optimizer state and gradient.

The public ``deepspeed.utils.safe_get_full_*`` / ``safe_set_full_*`` helpers take a model parameter and
need to find where its master copy lives. A wrapped optimizer calls :func:`attach_hp_mapping` once,
after it has built its groups, and every managed parameter gets one attribute, ``_hp_mapping`` (the
name upstream's helpers and integrations test for), holding a small object that knows its optimizer,
group and slot. Nothing else is stored on the parameter.

ZeRO-1/2: a parameter's master values are spread over the data-parallel ranks (a parameter may straddle
two partitions). A *full* read is collective: every rank writes the fragment it owns into a zeroed
buffer of the parameter's size and one ``all_reduce(SUM)`` assembles the whole, so every rank of the
data-parallel group must call it, in the same order. A *full* write is local: each rank copies its
own fragment out of the given value; the working (bit16) weights see the change when the optimizer
next publishes them (after its next step).

Gradients ([Note: gradient lifetime] in ``grads/partitions.py``): the lean paths drop autograd's ``.grad`` as
soon as it has been folded into a bucket, so a full gradient exists only as partition gradients, from
the first backward of an accumulation window until the step (or ``zero_grad``) consumes it. Stage 2
holds the reduced (averaged) gradient from each backward on; lean stage 1 reduces only in the
window's last backward, so before that the owner's fragments are its local, unreduced sums. Values
are still multiplied by the fp16 loss scale: unscaling happens inside the step.

Stage 0: parameters are whole on every rank. The mapping points at the fp32 master when the
optimizer keeps one, else at the parameter itself; reads return copies and need no collective.

Lifetime: a mapping holds its optimizer (and stage-0 master) only through weak references, so a model
that outlives its engine does not keep the fp32 masters, optimizer state or flat buffers alive. Once
the optimizer is gone the mapping reports ``alive`` False and the public helpers treat the parameter
as unmanaged.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from deepspeed._core.comm import dist
from deepspeed._core.comm.collectives import sum_over

GRAD_UNAVAILABLE = "Gradients are only available between a backward and the optimizer step (or zero_grad)"


def _state_of(optimizer: torch.optim.Optimizer, master: torch.Tensor, key: str) -> torch.Tensor:
    """``optimizer.state[master][key]``, with an error naming the key when it does not exist (yet)."""
    state = optimizer.state.get(master, {})
    if key not in state or not torch.is_tensor(state[key]):
        known = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == master.shape)
        raise ValueError(
            f"optimizer state key {key!r} not found for this parameter; available keys: {known} "
            "(state exists only after the first optimizer step)"
        )
    return state[key]


class ZeroHpMapping:
    """Where one ZeRO-1/2 parameter's fragment lives on this rank.

    Args:
        zero_optimizer: the owning ``ZeroOptimizer`` (groups, inner optimizer, data-parallel group).
        group_index: index of the flat group holding the parameter.
        slot_index: the parameter's slot in that group's layout.
    """

    def __init__(self, zero_optimizer: Any, group_index: int, slot_index: int) -> None:
        self._optimizer_ref = weakref.ref(zero_optimizer)
        self.group_index = group_index
        self.slot = zero_optimizer.groups[group_index].flat.layout.slots[slot_index]

    @property
    def alive(self) -> bool:
        """False once the owning optimizer has been garbage-collected."""
        return self._optimizer_ref() is not None

    @property
    def optimizer(self) -> Any:
        """The owning ZeRO optimizer (raises once it is gone)."""
        opt = self._optimizer_ref()
        if opt is None:
            raise RuntimeError("the optimizer that managed this parameter no longer exists")
        return opt

    @property
    def _group(self) -> Any:
        return self.optimizer.groups[self.group_index]

    @property
    def lp_range(self) -> Any:
        """Elements of the flattened parameter this rank owns (``Range``, possibly empty)."""
        owned = self.slot.range.intersect(self._group.partition)
        return owned.shift(-self.slot.offset)

    @property
    def hp_range(self) -> Any:
        """Where :attr:`lp_range` sits inside this rank's master partition."""
        return self.lp_range.shift(self.slot.offset - self._group.partition.start)

    def get_hp_fragment(self, optim_state_key: str | None = None) -> torch.Tensor:
        """This rank's 1-D fp32 fragment of the parameter (or of one optimizer state); a view, maybe empty."""
        self._before_access(write=False)
        master = self._group.master.param
        source = (
            master.data if optim_state_key is None else _state_of(self.optimizer.optimizer, master, optim_state_key)
        )
        return source[self.hp_range.as_slice()]

    def _before_access(self, write: bool) -> None:
        """Let the optimizer bring values it keeps elsewhere home first (ZenFlow's device columns)."""
        hook = getattr(self.optimizer, "before_master_access", None)
        if hook is not None:
            hook(write)

    def _gather(self, local: torch.Tensor | None) -> torch.Tensor:
        """Assemble the full fp32 parameter-shaped tensor from every rank's fragment (collective)."""
        device = self._group.flat.device
        full = torch.zeros(self.slot.numel, dtype=torch.float32, device=device)
        if local is not None and local.numel():
            full[self.lp_range.as_slice()] = local.to(device=device, dtype=torch.float32)
        # Over the ranks this flat group is partitioned across (an MoE group's is its expert-data group).
        pg = getattr(self._group, "process_group", self.optimizer.dp_group)
        if dist.get_world_size(group=pg) > 1:
            sum_over(full, pg)
        return full.view(self.slot.shape)

    def get_full_hp_param(self, optim_state_key: str | None = None) -> torch.Tensor:
        """The whole fp32 master value (or optimizer state); every data-parallel rank must call it."""
        return self._gather(self.get_hp_fragment(optim_state_key))

    def set_full_hp_param(self, value: torch.Tensor, optim_state_key: str | None = None) -> None:
        """Copy this rank's fragment of ``value`` (the whole parameter) into the master or state."""
        self._before_access(write=True)
        fragment = self.get_hp_fragment(optim_state_key)
        with torch.no_grad():
            fragment.copy_(value.detach().reshape(-1)[self.lp_range.as_slice()])

    def _grad_fragment(self) -> torch.Tensor | None:
        """This rank's fragment of the current partition gradient (a view), or None when it holds none."""
        grads = self._group.grads
        if grads.partition_grad is not None:
            return grads.partition_grad[self.hp_range.as_slice()]
        if grads.accumulator is not None:  # lean stage 1: full-size accumulator, group coordinates
            return grads.accumulator[self.lp_range.shift(self.slot.offset).as_slice()]
        return None

    def get_full_hp_grad(self) -> torch.Tensor:
        """The whole gradient (fp32) assembled from the owners' partition gradients (collective).

        Raises:
            ValueError: outside the backward → step window (the same on every rank, before any collective).
        """
        if self.optimizer._cleared_after_step:
            raise ValueError(GRAD_UNAVAILABLE)
        return self._gather(self._grad_fragment())

    def set_full_hp_grad(self, value: torch.Tensor) -> None:
        """Overwrite this rank's fragment of the partition gradient with the matching part of ``value``."""
        if self.optimizer._cleared_after_step:
            raise ValueError(GRAD_UNAVAILABLE)
        fragment = self._grad_fragment()
        if fragment is None:
            if self.lp_range.is_empty:
                return
            raise ValueError(GRAD_UNAVAILABLE + ": no gradient buffer holds this parameter's fragment yet")
        hook = getattr(self.optimizer, "before_grad_write", None)
        if hook is not None:
            hook()
        with torch.no_grad():
            fragment.copy_(value.detach().reshape(-1)[self.lp_range.as_slice()])


class ReplicatedHpMapping:
    """Stage 0: the parameter is whole on every rank; ``master`` is its fp32 copy (or the parameter).

    Args:
        inner: the inner torch optimizer (holds the state, keyed by ``master``).
        param: the model (working) parameter (only its shape is kept).
        master: the tensor the inner optimizer steps on.
    """

    def __init__(self, inner: torch.optim.Optimizer, param: torch.nn.Parameter, master: torch.nn.Parameter) -> None:
        self._inner_ref = weakref.ref(inner)
        self._master_ref = weakref.ref(master)
        self.shape = param.shape

    @property
    def alive(self) -> bool:
        """False once the inner optimizer or the master has been garbage-collected."""
        return self._inner_ref() is not None and self._master_ref() is not None

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The inner torch optimizer (raises once it is gone)."""
        inner = self._inner_ref()
        if inner is None:
            raise RuntimeError("the optimizer that managed this parameter no longer exists")
        return inner

    @property
    def master(self) -> torch.nn.Parameter:
        """The tensor the inner optimizer steps on (raises once it is gone)."""
        master = self._master_ref()
        if master is None:
            raise RuntimeError("the master copy of this parameter no longer exists")
        return master

    def get_hp_fragment(self, optim_state_key: str | None = None) -> torch.Tensor:
        """The whole master (or optimizer state), flattened; a view."""
        if optim_state_key is None:
            return self.master.data.reshape(-1)
        return _state_of(self.inner, self.master, optim_state_key).reshape(-1)

    def get_full_hp_param(self, optim_state_key: str | None = None) -> torch.Tensor:
        """An fp32 copy of the master (or optimizer state), parameter-shaped; no collective."""
        return self.get_hp_fragment(optim_state_key).to(torch.float32, copy=True).view(self.shape)

    def set_full_hp_param(self, value: torch.Tensor, optim_state_key: str | None = None) -> None:
        """Overwrite the master (or optimizer state); with a separate master the weights follow at the next step."""
        with torch.no_grad():
            self.get_hp_fragment(optim_state_key).copy_(value.detach().reshape(-1))

    def get_full_hp_grad(self) -> torch.Tensor | None:
        """The master's gradient (exists only inside a step); ``param.grad`` is read by the caller first."""
        grad = self.master.grad
        return None if grad is None else grad.to(torch.float32, copy=True).view(self.shape)

    def set_full_hp_grad(self, value: torch.Tensor) -> None:
        """Overwrite the master's gradient when it exists (the caller writes ``param.grad`` first)."""
        if self.master.grad is not None:
            with torch.no_grad():
                self.master.grad.copy_(value.detach().reshape(self.master.grad.shape))


def attach_hp_mapping(wrapped_optimizer: Any) -> None:
    """Give every parameter managed by ``wrapped_optimizer`` its ``_hp_mapping`` (idempotent).

    Accepts the ZeRO-1/2 optimizer (``groups`` with ``params``) and the stage-0 optimizer (``params``,
    optional ``masters``). Parameters are frozen-safe: only trainable parameters are managed.
    """
    groups = getattr(wrapped_optimizer, "groups", None)
    if groups is not None:
        for gi, group in enumerate(groups):
            for si, param in enumerate(group.params):
                param._hp_mapping = ZeroHpMapping(wrapped_optimizer, gi, si)
        return
    masters = getattr(wrapped_optimizer, "masters", None)
    pairs = masters.pairs if masters is not None else [(p, p) for p in wrapped_optimizer.params]
    for param, master in pairs:
        param._hp_mapping = ReplicatedHpMapping(wrapped_optimizer.optimizer, param, master)


def detach_hp_mapping(wrapped_optimizer: Any) -> None:
    """Remove the ``_hp_mapping`` attributes :func:`attach_hp_mapping` set (used by ``destroy``)."""
    groups = getattr(wrapped_optimizer, "groups", None)
    params = [p for g in groups for p in g.params] if groups is not None else list(wrapped_optimizer.params)
    for param in params:
        if hasattr(param, "_hp_mapping"):
            del param._hp_mapping
