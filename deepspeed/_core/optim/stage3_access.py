"""Per-parameter access to ZeRO-3 fp32 masters, optimizer state and gradients (``safe_get_*`` backend).

Each trainable ZeRO-3 parameter owns ``layout.partition_numel`` consecutive elements of its group's fp32
master shard on every rank (the valid part first, zero padding after). "Local" accessors read or write
this rank's valid slice; "full" accessors all-gather the slices (collective: every rank must call).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed._core.comm.collectives import gather_rows
from deepspeed._core.params.param import ZeroParam


@dataclass(frozen=True)
class Region:
    """Where one trainable ZeRO-3 parameter's shard sits in its group's flat master: group index, start, state."""

    group: int
    offset: int
    state: ZeroParam


class ShardIndex:
    """Every optimized parameter's :class:`Region`, found by ``ds_id`` or by ``(group, offset)`` in O(1).

    One map of regions, built once from the groups' states and offsets (which never change after set-up).
    """

    def __init__(self, groups: Sequence[Any]) -> None:
        self._by_id: dict[int, Region] = {}
        self._by_start: dict[tuple[int, int], Region] = {}
        for g, grp in enumerate(groups):
            for state, off in zip(grp.states, grp.offsets, strict=True):
                region = Region(g, off, state)
                self._by_id[state.ds_id] = region
                self._by_start[(g, off)] = region

    def get(self, ds_id: int | None) -> Region | None:
        """The region of the parameter with ``ds_id`` (``None`` when this optimizer does not step it)."""
        return None if ds_id is None else self._by_id.get(ds_id)

    def of(self, param: torch.nn.Parameter) -> Region:
        """The region of ``param``; a clear error for a parameter this optimizer does not step."""
        ds_id = getattr(param, "ds_id", None)
        region = self.get(ds_id)
        if region is None:
            raise ValueError(f"parameter with ds_id={ds_id} is not optimized by this ZeRO-3 optimizer")
        return region

    def at(self, group: int, offset: int) -> Region:
        """The region starting at ``offset`` of group ``group``'s flat master."""
        return self._by_start[(group, offset)]


class Stage3ParamAccess:
    """Mixin for ``Stage3Optimizer``: the methods ``deepspeed.utils.tensor_fragment`` calls on
    ``param._z3_optimizer``.

    It reads the optimizer only through this interface: ``index`` (a :class:`ShardIndex`), ``groups`` (each with
    a ``master``), the inner ``optimizer``, ``dp_group`` / ``world_size``, and the two window-gradient
    accessors :meth:`read_window_grad` / :meth:`write_window_grad`, which the optimizer implements (it knows where
    a gradient of the window lies: in the accumulator, or parked in the parameter's shard).
    """

    index: ShardIndex
    groups: list
    optimizer: torch.optim.Optimizer
    dp_group: Any
    world_size: int

    def read_window_grad(self, region: Region, size: int) -> torch.Tensor | None:
        """The first ``size`` elements of ``region``'s gradient in this window (``None`` outside one)."""
        raise NotImplementedError

    def write_window_grad(self, region: Region, values: torch.Tensor) -> None:
        """Overwrite the start of ``region``'s gradient in this window with the 1-D ``values``."""
        raise NotImplementedError

    def _flat(self, region: Region, key: str | None) -> torch.Tensor:
        """The group's flat fp32 tensor: the master (``key`` None) or an optimizer state (not the gradient,
        which is a :class:`~deepspeed._core.grads.accumulator.ChunkedGradShard`)."""
        master = self.groups[region.group].master
        if key is None:
            return master.data
        states = self.optimizer.state.get(master.param, {})
        value = states.get(key)
        if value is None:
            raise ValueError(f"optimizer state {key!r} does not exist (yet); known: {sorted(states)}")
        return value

    def _local(self, param: torch.nn.Parameter, key: str | None) -> torch.Tensor:
        region = self.index.of(param)
        return self._flat(region, key)[region.offset : region.offset + region.state.local_range.size]

    def _read(self, param: torch.nn.Parameter, key: str | None, size_of: Callable[[Any], int]) -> torch.Tensor | None:
        """``size_of(state)`` elements of ``param``'s slice of ``key`` (``"grad"``: ``None`` outside a window)."""
        region = self.index.of(param)
        size = size_of(region.state)
        if key == "grad":
            return self.read_window_grad(region, size)
        return self._flat(region, key)[region.offset : region.offset + size]

    def _write(self, param: torch.nn.Parameter, key: str | None, values: torch.Tensor) -> None:
        """Overwrite the start of ``param``'s slice of ``key`` with the 1-D ``values``."""
        region = self.index.of(param)
        with torch.no_grad():
            if key == "grad":
                self.write_window_grad(region, values)
                return
            local = self._flat(region, key)[region.offset : region.offset + values.numel()]
            local.copy_(values.to(local.device, dtype=local.dtype))

    def _full(self, param: torch.nn.Parameter, key: str | None) -> torch.Tensor | None:
        state = self.index.of(param).state
        slice_ = self._read(param, key, lambda s: s.layout.partition_numel)
        if slice_ is None:
            return None
        size = state.layout.partition_numel
        mine = slice_.to(state.full.device, dtype=torch.float32)
        gathered = torch.empty(size * self.world_size, dtype=torch.float32, device=state.full.device)
        gather_rows(gathered, mine.contiguous(), self.dp_group)
        return gathered[: state.numel].view(state.shape).to(slice_.device)

    # --- full (collective) ----------------------------------------------------------------------------
    def get_full_hp_param(self, param: torch.nn.Parameter, optim_state_key: str | None = None) -> torch.Tensor:
        """Full fp32 master (or optimizer state ``optim_state_key``) of ``param``; collective."""
        full = self._full(param, optim_state_key)
        assert full is not None  # only a gradient can be absent (outside a window)
        return full

    def set_full_hp_param(
        self, value: torch.Tensor, param: torch.nn.Parameter, optim_state_key: str | None = None
    ) -> None:
        """Write this rank's slice of the full ``value`` into the master (or an optimizer state)."""
        self._write_slice(value, param, optim_state_key)

    def get_fp32_grad_for_param(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """Full fp32 gradient accumulated so far in this window (``None`` outside one); collective."""
        return self._full(param, "grad")

    def set_fp32_grad_for_param(self, value: torch.Tensor, param: torch.nn.Parameter) -> None:
        """Write this rank's slice of the full gradient ``value``."""
        self._write_slice(value, param, "grad")

    def _write_slice(self, value: torch.Tensor, param: torch.nn.Parameter, key: str | None) -> None:
        rng = self.index.of(param).state.local_range
        self._write(param, key, value.reshape(-1)[rng.start : rng.end])

    def update_fp32_grad_for_param_vectorized(
        self,
        update_func: Callable[[torch.Tensor, torch.nn.Parameter], torch.Tensor],
        params: Sequence[torch.nn.Parameter],
    ) -> None:
        """Apply ``update_func(full_grad, param)`` to each parameter's full gradient; collective."""
        for p in params:
            full = self.get_fp32_grad_for_param(p)
            if full is not None:
                self.set_fp32_grad_for_param(update_func(full, p), p)

    # --- local (this rank's slice) --------------------------------------------------------------------
    def get_local_fp32_param(self, param: torch.nn.Parameter, optim_state_key: str | None = None) -> torch.Tensor:
        """This rank's valid slice of the fp32 master (or of an optimizer state)."""
        return self._local(param, optim_state_key).clone()

    def set_local_hp_param(
        self, value: torch.Tensor, param: torch.nn.Parameter, optim_state_key: str | None = None
    ) -> None:
        """Overwrite this rank's valid slice of the master (or of an optimizer state)."""
        self._write(param, optim_state_key, value.reshape(-1))

    def get_local_fp32_grad_for_param(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """This rank's valid slice of the accumulated fp32 gradient (``None`` outside a window)."""
        return self._read(param, "grad", lambda s: s.local_range.size)

    def set_local_grad_for_param(self, value: torch.Tensor, param: torch.nn.Parameter) -> None:
        """Overwrite this rank's valid slice of the fp32 gradient."""
        self._write(param, "grad", value.reshape(-1))
