"""Upstream ``partitioned_param_coordinator`` names over the ZeRO-3 parameter manager.

``PartitionedParameterCoordinator`` here is a view of :class:`~deepspeed._core.params.manager.ZeroParamManager`
(obtained from ``DeepSpeedZeRoOffload.get_param_coordinator()``), not a separately constructed object.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from torch import nn

from deepspeed._core.params.manager import ZeroParamManager
from deepspeed._core.params.prefetch import TraceMode

ZeRoTraceMode = TraceMode


def get_all_parameters(sub_module: nn.Module, recurse: bool = False) -> Iterator[tuple[str, nn.Parameter]]:
    """``(name, param)`` of the module's parameters followed by its external parameters."""
    # The manager binds ``ds_external_parameters`` onto a module it registers; a plain module has none.
    external_of = getattr(sub_module, "ds_external_parameters", None)
    external = external_of() if external_of is not None else []
    return itertools.chain(sub_module.named_parameters(recurse=recurse), external)


def iter_params(module: nn.Module, recurse: bool = False) -> list[nn.Parameter]:
    """The module's parameters plus its external parameters."""
    return [param for _, param in get_all_parameters(module, recurse)]


class PartitionedParameterCoordinator:
    """Upstream method names for fetching/releasing submodules, delegated to the manager."""

    def __init__(self, manager: ZeroParamManager) -> None:
        """View ``manager``."""
        self.manager = manager

    def fetch_sub_module(self, current_submodule: nn.Module, forward: bool) -> None:
        """Gather ``current_submodule``'s parameters."""
        self.manager.fetch(current_submodule)

    def release_sub_module(self, submodule: nn.Module, forward: bool = False) -> None:
        """Release ``submodule``'s parameters (when no other use is active)."""
        self.manager.release(submodule)

    def release_and_reset_all(self, module: nn.Module) -> None:
        """Release everything gathered."""
        self.manager.release_all()

    def reset_step(self) -> None:
        """Start a new step of the prefetch trace."""
        self.manager.trace.begin_step()

    def is_complete_trace(self) -> bool:
        """True when the trace is replaying."""
        return self.manager.trace.mode is TraceMode.COMPLETE

    def is_invalid_trace(self) -> bool:
        """True when the trace was invalidated."""
        return self.manager.trace.mode is TraceMode.INVALID

    def is_record_trace(self) -> bool:
        """True while recording."""
        return self.manager.trace.mode is TraceMode.RECORD
