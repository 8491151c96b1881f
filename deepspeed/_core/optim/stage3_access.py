"""Per-parameter access to ZeRO-3 fp32 masters, optimizer state and gradients (``safe_get_*`` backend).

Each trainable ZeRO-3 parameter owns ``layout.partition_numel`` consecutive elements of its group's fp32
master shard on every rank (the valid part first, zero padding after). "Local" accessors read or write
this rank's valid slice; "full" accessors all-gather the slices (collective: every rank must call).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from deepspeed._core.comm.collectives import gather_rows


class Stage3ParamAccess:
    """Mixin for ``Stage3Optimizer``: the methods ``deepspeed.utils.tensor_fragment`` calls on
    ``param._z3_optimizer``."""

    groups: list
    _folded: set  # (group index, offset) regions written in this window
    _where: dict  # ds_id -> (group index, offset)
    optimizer: torch.optim.Optimizer
    dp_group: Any
    world_size: int

    def _where_is(self, param: torch.nn.Parameter) -> tuple[Any, Any, int]:
        ds_id = getattr(param, "ds_id", None)
        for grp in self.groups:
            for state, off in zip(grp.states, grp.offsets, strict=False):
                if state.ds_id == ds_id:
                    return grp, state, off
        raise ValueError(f"parameter with ds_id={ds_id} is not optimized by this ZeRO-3 optimizer")

    def _flat(self, grp: Any, key: str | None) -> torch.Tensor:
        """The group's flat fp32 tensor: the master (``key`` None) or an optimizer state (not the gradient,
        which is a :class:`~deepspeed._core.grads.accumulator.ChunkedGradShard`)."""
        if key is None:
            return grp.master.data
        value = self.optimizer.state.get(grp.master.param, {}).get(key)
        if value is None:
            raise ValueError(
                f"optimizer state {key!r} does not exist (yet); known: "
                f"{sorted(self.optimizer.state.get(grp.master.param, {}))}"
            )
        return value

    def _local(self, param: torch.nn.Parameter, key: str | None) -> torch.Tensor:
        grp, state, off = self._where_is(param)
        return self._flat(grp, key)[off : off + state.local_range.size]

    def _read(self, param: torch.nn.Parameter, key: str | None, size_of: Callable[[Any], int]) -> torch.Tensor | None:
        """``size_of(state)`` elements of ``param``'s slice of ``key`` (``"grad"``: ``None`` outside a window)."""
        grp, state, off = self._where_is(param)
        if key == "grad":
            self.parked.evict(state)  # a gradient parked in the parameter's shard moves to the accumulator
            acc = grp.window_grad()
            return None if acc is None else acc.read(off, size_of(state))
        return self._flat(grp, key)[off : off + size_of(state)]

    def _write(self, param: torch.nn.Parameter, key: str | None, values: torch.Tensor) -> None:
        """Overwrite the start of ``param``'s slice of ``key`` with the 1-D ``values``."""
        grp, state, off = self._where_is(param)
        with torch.no_grad():
            if key == "grad":
                self.parked.evict(state)
                grp.ensure_accumulator().write(off, values)
                # A later fold of this window must add to the written values, not copy over them.
                self._folded.add(self._where[state.ds_id])
                return
            local = self._flat(grp, key)[off : off + values.numel()]
            local.copy_(values.to(local.device, dtype=local.dtype))

    def _full(self, param: torch.nn.Parameter, key: str | None) -> torch.Tensor | None:
        _, state, _ = self._where_is(param)
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
        return self._full(param, optim_state_key)

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
        _, state, _ = self._where_is(param)
        rng = state.local_range
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
