"""Every module hook, gradient hook and autograd.Function of ZeRO-3: the only place hooks are registered.

Per module, four forward-time hooks ([Note: zero3-hooks] in ``docs/design/zero3.md``):

* forward pre-hook -> ``target.pre_forward(module)`` (fetch);
* forward post-hook -> ``target.post_forward(module)`` (release);
* forward pre-hook that routes the module's grad-requiring inputs through :class:`_PostBackward`, whose
  backward runs once the gradients of all those inputs exist, i.e. after the module's backward
  -> ``target.post_backward(module)``;
* forward post-hook that puts a multi-grad hook ("any") on the grad-requiring outputs (a plain tensor hook when
  there is one), which fires before any of the module's backward runs -> ``target.pre_backward(module)``.

Both backward hooks are set up per call, so a module called twice gets two pre/post-backward pairs; the unit's
use count in the manager keeps its parameters gathered until the last one. The first pre-backward of a backward
pass queues an engine callback -> ``target.backward_finished()``, which releases what no post-backward reached
(modules whose inputs need no gradient, such as an embedding). Per trainable parameter a post-accumulate-grad
hook -> ``target.grad_ready(param)`` is the "full gradient is ready" seam for the ZeRO-3 optimizer.

Routed uses ([Note: routed grads] in :mod:`deepspeed._core.params.grad_route`): while a module's forward runs,
its dictionary returns the parameters :meth:`ModuleHooks.route` named for it as a routed use, whose gradient
goes to ``target.grad_arrived(param, grad)`` instead of into ``param.grad``.

Each hooked module's ``_parameters`` dict is swapped for a :class:`GatheringParameterDict`, so that reading a
partitioned parameter by attribute (``self.other.weight`` in a forward that does not run ``other``) reports
``target.on_param_access(param)`` (upstream's ``ZeROOrderedDict`` behaviour); iteration is unaffected. The
original dict object is restored, with its current contents, by :meth:`ModuleHooks.remove`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from deepspeed._core.params.grad_route import routed_use
from deepspeed._core.params.param import ShardedState, ZeroParameter


class HookTarget(Protocol):
    """What the hooks call; implemented by the parameter manager."""

    def pre_forward(self, module: nn.Module) -> None:
        """Before ``module.forward``."""

    def post_forward(self, module: nn.Module) -> None:
        """After ``module.forward``."""

    def pre_backward(self, module: nn.Module) -> None:
        """Before any backward computation of one call of ``module``."""

    def post_backward(self, module: nn.Module) -> None:
        """After the backward of one call of ``module`` produced its input gradients."""

    def backward_finished(self) -> None:
        """The autograd engine finished the current backward pass."""

    def grad_ready(self, param: nn.Parameter) -> None:
        """``param.grad`` holds this backward's full gradient."""

    def grad_arrived(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """One routed use of ``param`` produced ``grad`` (full shape); ``param.grad`` is not involved."""

    def on_param_access(self, param: nn.Parameter) -> None:
        """A partitioned, not-gathered ``param`` was read through its module's attribute."""


class GatheringParameterDict(dict):
    """``Module._parameters`` replacement that reports reads of partitioned parameters that are not gathered,
    and hands out routed uses of the :attr:`routed` names while the module's forward runs."""

    def __init__(self, original: dict, on_access: Callable[[nn.Parameter], None], hooks: ModuleHooks) -> None:
        """Copy ``original``'s entries; call ``on_access(param)`` on reads of a non-``FULL`` ZeRO parameter."""
        super().__init__(original)
        self._on_access = _eager(on_access)  # gathers, i.e. swaps param.data: never traced
        self._hooks = hooks
        self.routed: frozenset[str] = frozenset()
        self.forward_depth = 0  # > 0 inside this module's forward (the hooks count calls in and out)

    def __getitem__(self, key: str) -> Any:
        param = super().__getitem__(key)
        if type(param) is ZeroParameter:
            if param._ds_state.state is not ShardedState.FULL:
                self._on_access(param)
            if self.forward_depth and key in self.routed and self._hooks.routing and torch.is_grad_enabled():
                return routed_use(param, self._hooks.target.grad_arrived)
        return param


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward signals that the module's backward is done."""

    @staticmethod
    def forward(ctx: Any, hooks: ModuleHooks, module: nn.Module, *tensors: torch.Tensor) -> tuple:
        ctx.hooks = hooks
        ctx.module = module
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        ctx.hooks.on_post_backward(ctx.module)
        return (None, None, *grads)


_LEAVES = (torch.Tensor, bool, int, float, str)
"""Argument types that cannot hold tensors inside: calls made only of these (and no kwargs) skip the pytree path;
anything else (containers, named tuples, registered pytree nodes) takes it."""


def _grad_tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    return [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]


def _eager(fn: Callable) -> Callable:
    """``fn`` run eagerly under ``torch.compile``: a graph break, never traced (see [Note: zero3 under compile])."""
    return torch.compiler.disable(fn, recursive=True)


class ModuleHooks:
    """Installs and removes the ZeRO-3 hooks of a module tree.

    ``forward_hooks`` and ``backward_hooks`` are the handle lists upstream exposes on ``parameter_offload``
    (TRL removes and re-adds them around generation).
    """

    def __init__(self, target: HookTarget) -> None:
        """Route every hook to ``target``."""
        self.target = target
        self.forward_hooks: list[RemovableHandle] = []
        self.backward_hooks: list[RemovableHandle] = []
        self.grad_hooks: list[RemovableHandle] = []
        self._swapped: list[tuple[nn.Module, dict]] = []
        self._end_queued = False
        self.modules: list[nn.Module] = []  # every hooked module, in registration order
        self.routing = False  # routed uses are handed out only while this is on (see route)

    # ---------------------------------------------------------------- registration
    def register_module(self, root: nn.Module, stop_below: Callable[[nn.Module], bool]) -> int:
        """Hook ``root`` and its descendants, not descending below modules where ``stop_below`` is true.

        Returns the number of modules hooked.
        """
        count = 0
        stack = [root]
        while stack:
            module = stack.pop()
            self._hook_one(module)
            count += 1
            if not stop_below(module):
                stack.extend(reversed(list(module.children())))
        return count

    def _hook_one(self, module: nn.Module) -> None:
        target = self.target

        def fetch(mod: nn.Module, args: Any) -> None:
            target.pre_forward(mod)
            params = mod.__dict__["_parameters"]
            if type(params) is GatheringParameterDict:
                params.forward_depth += 1

        def release(mod: nn.Module, args: Any, output: Any) -> None:
            params = mod.__dict__["_parameters"]
            if type(params) is GatheringParameterDict and params.forward_depth:
                params.forward_depth -= 1
            target.post_forward(mod)

        fetch, release = _eager(fetch), _eager(release)
        self.forward_hooks.append(module.register_forward_pre_hook(fetch))
        # always_call: a non-reentrant checkpoint stops its recompute early by raising out of the last
        # module it needs; without it that module would stay gathered until the backward ends.
        self.forward_hooks.append(module.register_forward_hook(release, always_call=True))
        self.backward_hooks.append(module.register_forward_pre_hook(self._wrap_inputs, with_kwargs=True))
        self.backward_hooks.append(module.register_forward_hook(self._watch_outputs))
        original = module.__dict__["_parameters"]
        if not isinstance(original, GatheringParameterDict):
            module.__dict__["_parameters"] = GatheringParameterDict(original, target.on_param_access, self)
            self._swapped.append((module, original))
        self.modules.append(module)

    def route(self, keys: dict[int, frozenset[str]]) -> None:
        """Route the uses of the named parameters of each hooked module (``keys``: module ``id`` -> names),
        replacing any earlier routing; :attr:`routing` switches them on and off as a whole."""
        for module in self.modules:
            params = module.__dict__["_parameters"]
            if isinstance(params, GatheringParameterDict):
                params.routed = keys.get(id(module), frozenset())

    def register_grad_hooks(self, params: Iterable[nn.Parameter]) -> None:
        """Call ``target.grad_ready(param)`` after each backward accumulated ``param``'s gradient."""
        seen: set[int] = set()
        for param in params:
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                self.grad_hooks.append(param.register_post_accumulate_grad_hook(self.target.grad_ready))

    def remove(self) -> None:
        """Remove every hook this object registered."""
        for handle in (*self.forward_hooks, *self.backward_hooks, *self.grad_hooks):
            handle.remove()
        self.forward_hooks.clear()
        self.backward_hooks.clear()
        self.grad_hooks.clear()
        self.routing = False
        self.modules.clear()
        for module, original in self._swapped:
            current = module.__dict__["_parameters"]
            original.clear()
            original.update(dict.items(current))
            module.__dict__["_parameters"] = original
        self._swapped.clear()

    # ---------------------------------------------------------------- backward plumbing
    def _wrap_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not torch.is_grad_enabled():
            return None
        if not kwargs and all(isinstance(a, _LEAVES) or a is None for a in args):
            # The common call (``layer(x)``) skips the pytree round trip: these hooks run on every module call,
            # and their host time is what a ZeRO-3 step waits on (benchmarks/zero3_hook_overhead.py).
            positions = [i for i, v in enumerate(args) if isinstance(v, torch.Tensor) and v.requires_grad]
            if not positions:
                return None
            wrapped = _PostBackward.apply(self, module, *(args[i] for i in positions))
            new_args = list(args)
            for i, tensor in zip(positions, wrapped, strict=True):
                new_args[i] = tensor
            return tuple(new_args), kwargs
        flat, spec = pytree.tree_flatten((args, kwargs))
        positions = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor) and v.requires_grad]
        if not positions:
            return None
        wrapped = _PostBackward.apply(self, module, *(flat[i] for i in positions))
        for i, tensor in zip(positions, wrapped, strict=True):
            flat[i] = tensor
        return pytree.tree_unflatten(flat, spec)

    def _watch_outputs(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        if isinstance(output, torch.Tensor):
            tensors = [output] if output.requires_grad else []
        else:
            tensors = _grad_tensors(pytree.tree_leaves(output))
        if len(tensors) == 1:
            # One output (the usual case): a plain tensor hook fires at the same point, before the module's
            # backward, without the handle and per-tensor bookkeeping a multi-grad hook builds.
            tensors[0].register_hook(lambda grad: self.on_pre_backward(module))
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads: self.on_pre_backward(module), mode="any"
            )

    def on_pre_backward(self, module: nn.Module) -> None:
        """Pre-backward of one call of ``module`` (runs inside the autograd engine)."""
        if not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        self.target.pre_backward(module)

    def on_post_backward(self, module: nn.Module) -> None:
        """Post-backward of one call of ``module`` (runs inside the autograd engine)."""
        self.target.post_backward(module)

    def _on_backward_end(self) -> None:
        self._end_queued = False
        self.target.backward_finished()
