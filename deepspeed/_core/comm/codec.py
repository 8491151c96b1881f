"""How a parameter shard travels through the all-gather: the :class:`ShardCodec` protocol.

The gather path never branches on a "quantized weights" flag. Instead it asks a codec for the dtype the shards
travel in, lets it write each local shard into the send buffer (``encode``) and lets it turn each rank's received
chunk back into parameter values (``decode``). The identity codec (the default) copies; a quantizing codec (ZeRO++
qwZ, fp8 weights) plugs in here without touching :mod:`deepspeed._core.comm.collectives` ([Note: zero3-codec] in
``docs/design/zero3.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ShardCodec(Protocol):
    """Encode before the all-gather, decode after it. Implementations must be stateless per call."""

    def wire_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """Element type of the flat all-gather buffer for parameters of ``param_dtype``."""

    def encode(self, shards: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        """Write the 1-D local ``shards`` back to back into ``out`` (this rank's 1-D row of the send buffer)."""

    def decode(self, received: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        """Write ``received`` (``[world, row]`` wire values) into ``outs``: output ``i`` is ``[world, n_i]`` in the
        parameter dtype and takes the next ``n_i`` columns (the widths tile the row)."""


class IdentityCodec:
    """The default codec: shards travel in the parameter dtype, unchanged.

    Both directions are one batched copy per call, not one per parameter: ``encode`` is one concatenation into
    the row, ``decode`` one split-copy into every output (the same two kernels FSDP2's gather uses), so a unit's
    gather costs two copy launches whatever its parameter count ([Note: zero3-codec]).
    """

    def wire_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The parameter dtype itself."""
        return param_dtype

    def encode(self, shards: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        """One concatenation; shards in (pinned) host memory are copied one by one, asynchronously.

        Both convert: a shard wider than ``out`` (an fp32 master view) lands in ``out``'s dtype."""
        if all(shard.device == out.device for shard in shards):
            torch.cat(list(shards), out=out)
            return
        start = 0
        for shard in shards:
            out.narrow(0, start, shard.numel()).copy_(shard, non_blocking=True)
            start += shard.numel()

    def decode(self, received: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        """One split-copy of the columns into the outputs."""
        if len(outs) == 1:
            outs[0].copy_(received)
            return
        torch.split_with_sizes_copy(received, [out.shape[1] for out in outs], dim=1, out=list(outs))


IDENTITY_CODEC = IdentityCodec()
"""Shared stateless instance used when no codec is configured."""
