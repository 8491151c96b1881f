"""Where ZeRO-3 parameter shards live: on the compute device, or offloaded to (pinned) host memory.

With ``offload_param: {device: cpu}`` each ``ds_tensor`` is a host tensor, page-locked when ``pin_memory`` is on,
while gathered parameters still live on the compute device. The all-gather's copy-in then doubles as the
host-to-device transfer: it runs asynchronously on the all-gather stream, straight from the pinned shard into the
flat buffer's local row ([Note: zero3-offload] in ``docs/design/zero3.md``). Anything that writes an offloaded
shard on the host (a CPU optimizer step) must first call ``Gatherer.sync_shard_reads()``, the one host wait
this design needs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from deepspeed._core.config.plan import OffloadDevice, OffloadPolicy
from deepspeed.accelerator import get_accelerator


class Pinning(enum.Enum):
    """Whether host-resident shards are page-locked (needed for truly asynchronous copies)."""

    PAGEABLE = "pageable"
    PINNED = "pinned"


@dataclass(frozen=True)
class ShardPlacement:
    """Where shards are allocated.

    Attributes:
        device: shard device; ``None`` keeps each parameter's own (compute) device.
        pinning: page-lock host shards.
    """

    device: torch.device | None = None
    pinning: Pinning = Pinning.PAGEABLE

    @classmethod
    def from_policy(cls, policy: OffloadPolicy) -> ShardPlacement:
        """The placement for ``zero_optimization.offload_param``."""
        if policy.device is OffloadDevice.NONE:
            return cls()
        if policy.device is OffloadDevice.CPU:
            return cls(torch.device("cpu"), Pinning.PINNED if policy.pin_memory else Pinning.PAGEABLE)
        raise ValueError(f"offload_param.device={policy.device.value!r} is not supported; use 'none' or 'cpu'")

    def shard_device(self, compute_device: torch.device) -> torch.device:
        """The device a shard of a parameter computed on ``compute_device`` lives on."""
        return compute_device if self.device is None else self.device


def allocate_shard(
    numel: int, dtype: torch.dtype, compute_device: torch.device, placement: ShardPlacement
) -> torch.Tensor:
    """A zeroed 1-D shard of ``numel`` elements placed according to ``placement``."""
    device = placement.shard_device(compute_device)
    shard = torch.zeros(numel, dtype=dtype, device=device)
    if placement.pinning is Pinning.PINNED and device.type == "cpu" and compute_device.type != "cpu":
        shard = get_accelerator().pin_memory(shard)
    return shard
