"""How a parameter shard travels through the all-gather: the :class:`ShardCodec` protocol.

The gather path never branches on a "quantized weights" flag. Instead it asks a codec for the dtype the shards
travel in, lets it write each local shard into the send buffer (``encode``) and lets it turn each rank's received
chunk back into parameter values (``decode``). The identity codec (the default) copies; a quantizing codec (ZeRO++
qwZ, fp8 weights) plugs in here without touching :mod:`deepspeed._core.zero.collectives` ([Note: zero3-codec] in
``docs/design/zero3.md``).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ShardCodec(Protocol):
    """Encode before the all-gather, decode after it. Implementations must be stateless per call."""

    def wire_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """Element type of the flat all-gather buffer for parameters of ``param_dtype``."""

    def encode(self, shard: torch.Tensor, out: torch.Tensor) -> None:
        """Write the 1-D local ``shard`` into ``out`` (a same-length 1-D slice of the send buffer)."""

    def decode(self, received: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``received`` (``[world, partition_numel]`` wire values) into ``out`` (same shape, param dtype)."""


class IdentityCodec:
    """The default codec: shards travel in the parameter dtype, unchanged."""

    def wire_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The parameter dtype itself."""
        return param_dtype

    def encode(self, shard: torch.Tensor, out: torch.Tensor) -> None:
        """Plain copy (asynchronous from a pinned host shard)."""
        out.copy_(shard, non_blocking=True)

    def decode(self, received: torch.Tensor, out: torch.Tensor) -> None:
        """Plain copy."""
        out.copy_(received)


IDENTITY_CODEC = IdentityCodec()
"""Shared stateless instance used when no codec is configured."""
