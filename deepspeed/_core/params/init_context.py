"""``zero.Init`` internals: partition each module's parameters as soon as that module is constructed.

Interception is minimal and scoped ([Note: zero3-init] in ``docs/design/zero3.md``): while the outermost context
is active, the ``__init__`` defined by each ``nn.Module`` subclass (existing ones, and those defined while the
context is open, via ``nn.Module.__init_subclass__``) is wrapped; when the outermost ``__init__`` call of an
instance returns, its not-yet-partitioned parameters are cast, broadcast from rank 0 and partitioned. No torch
tensor factory is patched. On exit every wrapped ``__init__`` and ``__init_subclass__`` is restored exactly.
Nested contexts only count depth.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from deepspeed._core.comm.collectives import broadcast_from
from deepspeed._core.comm.groups import ShardGroup
from deepspeed._core.comm.streams import StreamSet
from deepspeed._core.params.gather import Gatherer
from deepspeed._core.params.param import zero_state
from deepspeed._core.params.placement import ShardPlacement

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11


@dataclass(frozen=True)
class InitPlan:
    """Where and how ``zero.Init`` puts new parameters.

    Attributes:
        group: the group parameters are sharded over.
        dtype: floating-point parameters and buffers are cast to this dtype.
        device: the compute device: buffers and gathered parameters live here.
        placement: where shards live (the compute device unless ``remote_device='cpu'`` offloads them).
    """

    group: ShardGroup
    dtype: torch.dtype
    device: torch.device
    placement: ShardPlacement = field(default_factory=ShardPlacement)


def _all_subclasses(root: type) -> list[type]:
    found: list[type] = []
    stack: list[type] = list(root.__subclasses__())
    seen: set[type] = set()
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.add(cls)
        found.append(cls)
        stack.extend(cls.__subclasses__())
    return found


class ModuleInitInterceptor:
    """Wraps ``__init__`` of ``nn.Module`` subclasses; calls ``on_built(module)`` after the outermost one."""

    def __init__(self, on_built: Callable[[nn.Module], None]) -> None:
        """Nothing is wrapped until :meth:`install`."""
        self.on_built = on_built
        self._originals: dict[type, Callable[..., None]] = {}
        self._depth: dict[int, int] = {}
        self._saved_init_subclass: Any = None
        self._had_init_subclass = False
        self.installed = False

    def install(self) -> None:
        """Wrap every current subclass and hook the creation of new ones."""
        assert not self.installed, "interceptor installed twice"
        for cls in _all_subclasses(nn.Module):
            self._wrap(cls)
        self._had_init_subclass = "__init_subclass__" in nn.Module.__dict__
        self._saved_init_subclass = nn.Module.__dict__.get("__init_subclass__")
        interceptor = self

        def init_subclass(cls: type[nn.Module], **kwargs: Any) -> None:
            super(nn.Module, cls).__init_subclass__(**kwargs)
            interceptor._wrap(cls)

        nn.Module.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]
        self.installed = True

    def uninstall(self) -> None:
        """Restore every wrapped ``__init__`` and ``nn.Module.__init_subclass__`` exactly."""
        for cls, original in self._originals.items():
            cls.__init__ = original  # type: ignore[misc]
        self._originals.clear()
        if self._had_init_subclass:
            nn.Module.__init_subclass__ = self._saved_init_subclass  # type: ignore[method-assign]
        else:
            del nn.Module.__init_subclass__
        self.installed = False

    def _wrap(self, cls: type) -> None:
        original = cls.__dict__.get("__init__")
        if original is None or cls in self._originals or not callable(original):
            return
        self._originals[cls] = original

        @functools.wraps(original)
        def init(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            key = id(module)
            depth = self._depth.get(key, 0)
            self._depth[key] = depth + 1
            try:
                original(module, *args, **kwargs)
            finally:
                if depth:
                    self._depth[key] = depth
                else:
                    del self._depth[key]
            if depth == 0:
                self.on_built(module)

        cls.__init__ = init  # type: ignore[misc]


class _Nesting:
    """Process-wide depth of open ``zero.Init`` contexts; only the outermost installs the interceptor."""

    def __init__(self) -> None:
        self.depth = 0
        self.active: ZeroInitContext | None = None


_NESTING = _Nesting()


def init_depth() -> int:
    """How many ``zero.Init`` contexts are open (0 when none)."""
    return _NESTING.depth


class ZeroInitContext:
    """Context manager partitioning parameters at module construction according to an :class:`InitPlan`."""

    def __init__(self, plan: InitPlan, gatherer: Gatherer | None = None) -> None:
        """Partition with ``gatherer`` (default: a stand-alone one on the accelerator's streams)."""
        self.plan = plan
        self.gatherer = gatherer if gatherer is not None else Gatherer(StreamSet(), placement=plan.placement)
        self._interceptor = ModuleInitInterceptor(self.partition_module)

    def __enter__(self) -> Self:
        if _NESTING.depth == 0:
            self._interceptor.install()
            _NESTING.active = self
        _NESTING.depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        _NESTING.depth -= 1
        if _NESTING.depth == 0 and _NESTING.active is self:
            self._interceptor.uninstall()
            _NESTING.active = None

    def partition_module(self, module: nn.Module) -> None:
        """Cast and place ``module``'s own buffers, then partition every parameter not yet partitioned."""
        plan = self.plan
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                dtype = plan.dtype if buffer.is_floating_point() else buffer.dtype
                module._buffers[name] = buffer.to(device=plan.device, dtype=dtype)
        for param in module.parameters():
            if zero_state(param) is None:
                self._partition_param(param)

    def _partition_param(self, param: nn.Parameter) -> None:
        plan = self.plan
        dtype = plan.dtype if param.is_floating_point() else param.dtype
        data = param.data.to(device=plan.device, dtype=dtype)
        # Ranks may have drawn different random initial values; rank 0's become everyone's.
        broadcast_from(data, plan.group, 0)
        param.data = data
        self.gatherer.partition(param, plan.group)
