"""Model-state floors: the bytes per parameter of the states a training mode must keep, per rank.

A training step with 16-bit parameters and gradients and Adam in fp32 holds, per parameter, 2 bytes of working
parameter, 2 bytes of gradient and 12 bytes of optimizer state (fp32 master copy, first and second moment). ZeRO
partitions some of these over the N ranks of the data-parallel group; what a rank must keep whatever the
implementation is its *model-state floor*. Activations, gathered layers, communication buffers and allocator
slack come on top, so a measured peak divided by the floor (``peak / floor``) says how much an engine adds.

| mode | device bytes per parameter | host bytes per parameter |
|---|---|---|
| ZeRO-0 (plain data parallel) | 16 | 0 |
| ZeRO-1 (optimizer state partitioned) | 2 + 2 + 12 / N | 0 |
| ZeRO-2 (gradients too) | 2 + 14 / N | 0 |
| ZeRO-2, optimizer offloaded | 2 + 2 / N | 12 / N |
| ZeRO-3 (parameters too) and FSDP2 | 16 / N | 0 |
| ZeRO-3, optimizer offloaded | 4 / N | 12 / N |
| ZeRO-3, optimizer and parameters offloaded | 2 / N | 14 / N |
| FSDP2, CPU offload | 0 | 16 / N |
| plain PyTorch, bf16 AdamW (one rank) | 8 | 0 |

The plain PyTorch row keeps its weights, gradients and both AdamW moments in bf16 (torch's AdamW keeps the moments
in the parameters' dtype), so it holds half the state of the mixed-precision modes: it is the speed floor, not a
memory target.
"""

from __future__ import annotations

GiB = float(1 << 30)


def bytes_per_param(impl: str, stage: int | None, n: int, offload: bool = False, offload_param: bool = False):
    """(device, host) bytes per parameter of the model-state floor of one rank of ``n`` (see the table above)."""
    if impl == "plain":
        return 8.0, 0.0
    if impl == "fsdp2":
        return (0.0, 16.0 / n) if offload else (16.0 / n, 0.0)
    if stage in (None, 3):
        if offload_param:
            return 2.0 / n, 14.0 / n
        return (4.0 / n, 12.0 / n) if offload else (16.0 / n, 0.0)
    if stage == 2:
        return (2.0 + 2.0 / n, 12.0 / n) if offload else (2.0 + 14.0 / n, 0.0)
    if stage == 1:
        return 4.0 + 12.0 / n, 0.0
    if stage == 0:
        return 16.0, 0.0
    raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")


def floor_gib(record: dict) -> float | None:
    """The device floor of a record's configuration in GiB, or None when the record has no parameter count or
    does not train in 16-bit precision (the formulas above assume it)."""
    params = record.get("params")
    if not isinstance(params, int) or record.get("dtype", "bf16") not in ("bf16", "fp16"):
        return None
    stage = record.get("stage")
    device, _ = bytes_per_param(
        str(record.get("impl")),
        None if stage is None else int(stage),
        int(record.get("world_size") or 1),
        bool(record.get("offload")),
        bool(record.get("offload_param")),
    )
    return device * params / GiB
