"""What a ZeRO optimizer exposes to load a universal checkpoint, independent of the file format.

A universal checkpoint stores every parameter whole (fp32 values and each optimizer moment), so it can be
resumed at any data-parallel size and any ZeRO stage. Loading it is two steps, split so that nothing is
changed before every file has been read:

1. the optimizer says, per flat group, which elements of which parameters this rank's flat master holds
   (:class:`UniversalTarget`, from ``universal_targets()``);
2. the reader fills one flat tensor per state for each group (:class:`UniversalGroupState`) and hands them
   back to ``load_universal_state()``, which installs them and publishes the weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from deepspeed._core.layout.shards import Range


@dataclass(frozen=True)
class UniversalSlice:
    """Elements ``param_range`` of the flattened full ``param`` sit at ``partition_range`` of the flat master."""

    param: torch.nn.Parameter
    param_range: Range
    partition_range: Range


@dataclass(frozen=True)
class UniversalTarget:
    """One flat group of this rank: the master's element count and the parameter pieces it is made of."""

    numel: int
    slices: tuple[UniversalSlice, ...]


@dataclass
class UniversalGroupState:
    """Values read for one flat group, laid out like this rank's flat master (padding left at zero).

    ``moments`` maps an optimizer-state name (``exp_avg``, ``exp_avg_sq``, ...) to its flat tensor; it is empty
    and ``step`` is ``None`` when only the weights are loaded. ``hyperparams`` are the saved group's settings.
    """

    fp32: torch.Tensor
    moments: dict[str, torch.Tensor] = field(default_factory=dict)
    step: Any = None
    hyperparams: dict[str, Any] = field(default_factory=dict)


def install(opt: Any, masters: list[torch.Tensor], states: list[UniversalGroupState], global_state: dict) -> None:
    """Copy the values into ``masters`` (one per group) and the inner optimizer; restore the loss scaler.

    ``opt`` is a ZeRO optimizer with an inner torch ``optimizer`` (one flat parameter per group) and
    ``loss_scaler`` / ``overflow`` attributes. The caller publishes the weights afterwards.
    """
    if len(masters) != len(states):
        raise ValueError(f"the universal state has {len(states)} groups but the optimizer has {len(masters)}")
    with torch.no_grad():
        for master, state in zip(masters, states, strict=True):
            master.copy_(state.fp32.to(master.device))
    if global_state.get("loss_scaler") is not None and getattr(opt, "loss_scaler", None) is not None:
        opt.loss_scaler = global_state["loss_scaler"]
    opt.overflow = bool(global_state.get("overflow", False))
    if any(s.moments or s.step is not None for s in states):
        opt.optimizer.load_state_dict(_inner_state_dict(opt.optimizer, states))


def _inner_state_dict(inner: torch.optim.Optimizer, states: list[UniversalGroupState]) -> dict:
    """A ``state_dict`` for ``inner`` whose group ``g`` holds the flat master of flat group ``g``."""
    state: dict[int, dict[str, Any]] = {}
    groups = []
    for index, (live, saved) in enumerate(zip(inner.param_groups, states, strict=True)):
        entry: dict[str, Any] = dict(saved.moments)
        if saved.step is not None:
            entry["step"] = saved.step.clone() if torch.is_tensor(saved.step) else saved.step
        if entry:
            state[index] = entry
        settings = {k: v for k, v in live.items() if k != "params"}
        settings.update({k: v for k, v in saved.hyperparams.items() if k != "params"})
        groups.append({**settings, "params": [index]})
    return {"state": state, "param_groups": groups}
