"""Where ZeRO-3 parameter shards live: on the compute device, or offloaded to (pinned) host memory.

With ``offload_param: {device: cpu}`` each ``ds_tensor`` is a host tensor, page-locked when ``pin_memory`` is on,
while gathered parameters still live on the compute device. The all-gather's copy-in then doubles as the
host-to-device transfer: it runs asynchronously on the all-gather stream, straight from the pinned shard into the
flat buffer's local row ([Note: zero3-offload] in ``docs/design/zero3.md``). Anything that writes an offloaded
shard on the host (a CPU optimizer step) must first call ``Gatherer.sync_shard_reads()``, the one host wait
this design needs.

[Note: shard arena] A model partitioned at ``initialize`` needs one shard per parameter. Allocated one by one,
each is rounded up by the caching allocator (to 2 MiB above 1 MiB, into 20 MiB segments between 1 and 10 MiB): for
the 3B model's ~250 bf16 shards that left reserved 2.4 % above allocated after ``initialize`` on the H200, and none
with one buffer (docs/benchmarks.md). When the shards stay for the whole run (the optimizer
keeps its master elsewhere) a few buffers hold them all, laid out from the sizes before anything is allocated, in
segments of about :data:`ARENA_SEGMENT_BYTES` in parameter order. A segment is allocated only when its first
parameter is partitioned, after every parameter before it has freed its full storage: a model built on the
accelerator then peaks at its own size plus one segment during ``initialize``, not plus all of its shards. Where
the shards are replaced by views of the device master later, or live in page-locked host memory (whose allocator
rounds every block up to a power of two), each keeps its own allocation. A shard cut from an arena is never freed
on its own (``free_storage`` refuses a view of a larger buffer); the arena goes when its last shard does.

[Note: own storage as shard] On one rank a parameter's shard is the whole parameter. A model built on the
accelerator in the working dtype and handed to ``initialize`` therefore already holds every shard; copying them
into new storage (an arena, or one allocation each) doubles the model's accelerator memory until the copies are
done, the largest peak such a run has. So a parameter whose data is contiguous, on the shard's device, in the
working dtype and alone in its storage keeps that storage as its shard, and nothing is allocated. A tensor that
shares its storage with anything else (a view of a larger buffer, one storage behind two parameters) is copied as
before, so no two shards alias. Switch: ``zero_optimization.lean_inplace_flatten``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deepspeed._core.comm.page_locked import locked_empty
from deepspeed._core.config.plan import OffloadDevice, OffloadPolicy


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
        if policy.device is OffloadDevice.NVME:
            # A new shard is filled on the host and then written to its swap file (or kept, when small or within
            # max_in_cpu, and pinned then): a pageable staging tensor, not a page-locked allocation per parameter.
            return cls(torch.device("cpu"), Pinning.PAGEABLE)
        raise ValueError(f"offload_param.device={policy.device.value!r} is not supported; use 'none', 'cpu' or 'nvme'")

    def shard_device(self, compute_device: torch.device) -> torch.device:
        """The device a shard of a parameter computed on ``compute_device`` lives on."""
        return compute_device if self.device is None else self.device


def allocate_shard(
    numel: int, dtype: torch.dtype, compute_device: torch.device, placement: ShardPlacement
) -> torch.Tensor:
    """A zeroed 1-D shard of ``numel`` elements placed according to ``placement``."""
    device = placement.shard_device(compute_device)
    if placement.pinning is Pinning.PINNED and device.type == "cpu" and compute_device.type != "cpu":
        # Page-locked at the shard's own size ([Note: exact page-locking]): through the caching host allocator
        # every shard would be rounded up to a power of two, up to twice the host memory of the parameters.
        return locked_empty(numel, dtype).zero_()
    return torch.zeros(numel, dtype=dtype, device=device)


ARENA_SEGMENT_BYTES = 1 << 28
"""An arena is cut in segments of about this many bytes of shards, each allocated once the parameters before it are
partitioned ([Note: shard arena])."""

SHARD_ALIGN_BYTES = 256
"""Each shard cut from an arena starts on this byte boundary, as a separately allocated one would (vectorised
copy and cast kernels want aligned starts); the padding costs under 256 bytes per parameter."""


def arena_segments(
    params: Sequence[torch.nn.Parameter], request: Callable[[torch.nn.Parameter], tuple[int, torch.dtype, torch.device]]
) -> list[list[torch.nn.Parameter]]:
    """``params`` in order, cut into runs whose shards (``request(param)``: numel, dtype, device) add up to at least
    :data:`ARENA_SEGMENT_BYTES` each (the last run: whatever is left)."""
    segments: list[list[torch.nn.Parameter]] = [[]]
    size = 0
    for param in params:
        if size >= ARENA_SEGMENT_BYTES:
            segments.append([])
            size = 0
        numel, dtype, _ = request(param)
        segments[-1].append(param)
        size += numel * torch.empty((), dtype=dtype).element_size()
    return [segment for segment in segments if segment]


def arena_shards(requests: Sequence[tuple[int, torch.dtype, torch.device]]) -> list[torch.Tensor]:
    """Zeroed 1-D shards for ``requests`` (``(numel, dtype, device)`` each, in order), cut from one buffer per dtype
    and device, each start aligned to :data:`SHARD_ALIGN_BYTES` ([Note: shard arena])."""
    offsets: list[int] = []
    totals: dict[tuple[torch.dtype, torch.device], int] = {}
    for numel, dtype, device in requests:
        key = (dtype, torch.device(device))
        align = max(1, SHARD_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
        used = totals.get(key, 0)
        start = -(-used // align) * align if numel else used  # an empty shard takes no room
        offsets.append(start)
        totals[key] = start + numel
    buffers = {key: torch.zeros(total, dtype=key[0], device=key[1]) for key, total in totals.items()}
    return [
        buffers[(dtype, torch.device(device))].narrow(0, start, numel)
        for (numel, dtype, device), start in zip(requests, offsets, strict=True)
    ]
