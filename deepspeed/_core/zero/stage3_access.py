"""Per-parameter access to ZeRO-3 fp32 masters, optimizer state and gradients (``safe_get_*`` backend).

Each trainable ZeRO-3 parameter owns ``layout.partition_numel`` consecutive elements of its group's fp32
master shard on every rank (the valid part first, zero padding after). "Local" accessors read or write
this rank's valid slice; "full" accessors all-gather the slices (collective: every rank must call).
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import torch

from deepspeed import comm as dist


class IfMissing(enum.Enum):
    """What to do when the gradient accumulator does not exist yet."""

    RETURN_NONE = "none"
    CREATE = "create"


class Stage3ParamAccess:
    """Mixin for ``Stage3Optimizer``: the methods ``deepspeed.utils.tensor_fragment`` calls on ``param._z3_optimizer``."""

    groups: list
    optimizer: torch.optim.Optimizer
    dp_group: Any
    world_size: int

    def _where_is(self, param: torch.nn.Parameter) -> tuple[Any, Any, int]:
        ds_id = getattr(param, "ds_id", None)
        for grp in self.groups:
            for state, off in zip(grp.states, grp.offsets):
                if state.ds_id == ds_id:
                    return grp, state, off
        raise ValueError(f"parameter with ds_id={ds_id} is not optimized by this ZeRO-3 optimizer")

    def _flat(self, grp: Any, key: str | None, missing: IfMissing = IfMissing.RETURN_NONE) -> torch.Tensor | None:
        """The group's flat fp32 tensor: the master (``key`` None), an optimizer state, or the gradient."""
        if key is None:
            return grp.master.data
        if key == "grad":
            return grp.ensure_accumulator() if missing is IfMissing.CREATE else grp.accumulator
        value = self.optimizer.state.get(grp.master, {}).get(key)
        if value is None:
            raise ValueError(f"optimizer state {key!r} does not exist (yet); known: "
                             f"{sorted(self.optimizer.state.get(grp.master, {}))}")
        return value

    def _local(self, param: torch.nn.Parameter, key: str | None, missing: IfMissing = IfMissing.RETURN_NONE) -> torch.Tensor | None:
        grp, state, off = self._where_is(param)
        flat = self._flat(grp, key, missing)
        if flat is None:
            return None
        return flat[off : off + state.local_range.size]

    def _full(self, param: torch.nn.Parameter, key: str | None) -> torch.Tensor | None:
        grp, state, off = self._where_is(param)
        flat = self._flat(grp, key)
        if flat is None:
            return None
        size = state.layout.partition_numel
        mine = flat[off : off + size].to(state.full.device, dtype=torch.float32)
        gathered = torch.empty(size * self.world_size, dtype=torch.float32, device=state.full.device)
        dist.all_gather_into_tensor(gathered, mine.contiguous(), group=self.dp_group)
        return gathered[: state.numel].view(state.shape).to(flat.device)

    # --- full (collective) ----------------------------------------------------------------------------
    def get_full_hp_param(self, param: torch.nn.Parameter, optim_state_key: str | None = None) -> torch.Tensor:
        """Full fp32 master (or optimizer state ``optim_state_key``) of ``param``; collective."""
        return self._full(param, optim_state_key)

    def set_full_hp_param(self, value: torch.Tensor, param: torch.nn.Parameter, optim_state_key: str | None = None) -> None:
        """Write this rank's slice of the full ``value`` into the master (or an optimizer state)."""
        self._write_slice(value, param, optim_state_key)

    def get_fp32_grad_for_param(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """Full fp32 gradient accumulated so far in this window (``None`` outside one); collective."""
        return self._full(param, "grad")

    def set_fp32_grad_for_param(self, value: torch.Tensor, param: torch.nn.Parameter) -> None:
        """Write this rank's slice of the full gradient ``value``."""
        self._write_slice(value, param, "grad")

    def _write_slice(self, value: torch.Tensor, param: torch.nn.Parameter, key: str | None) -> None:
        grp, state, off = self._where_is(param)
        rng = state.local_range
        local = self._local(param, key, IfMissing.CREATE)
        with torch.no_grad():
            local.copy_(value.reshape(-1)[rng.start : rng.end].to(local.device, dtype=local.dtype))

    def update_fp32_grad_for_param_vectorized(
        self, update_func: Callable[[torch.Tensor, torch.nn.Parameter], torch.Tensor],
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

    def set_local_hp_param(self, value: torch.Tensor, param: torch.nn.Parameter, optim_state_key: str | None = None) -> None:
        """Overwrite this rank's valid slice of the master (or of an optimizer state)."""
        local = self._local(param, optim_state_key)
        with torch.no_grad():
            local.copy_(value.reshape(-1).to(local.device, dtype=local.dtype))

    def get_local_fp32_grad_for_param(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """This rank's valid slice of the accumulated fp32 gradient (``None`` outside a window)."""
        local = self._local(param, "grad")
        return None if local is None else local.clone()

    def set_local_grad_for_param(self, value: torch.Tensor, param: torch.nn.Parameter) -> None:
        """Overwrite this rank's valid slice of the fp32 gradient."""
        local = self._local(param, "grad", IfMissing.CREATE)
        with torch.no_grad():
            local.copy_(value.reshape(-1).to(local.device, dtype=local.dtype))
