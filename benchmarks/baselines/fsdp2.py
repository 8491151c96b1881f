"""PyTorch FSDP2 baseline: the same model under ``torch.distributed.fsdp.fully_shard``, one call per block.

Configuration (the usual FSDP2 recipe, chosen to match the DeepSpeed runs): fp32 sharded parameters, bf16
compute through ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, fp32 gradients, torch AdamW
(fused) on the fp32 shards, ``clip_grad_norm_(1.0)``, accumulation by plain repeated backward (gradients
reduced every micro-step, as FSDP2 does unless ``set_requires_gradient_sync(False)``). Its model-state floor is
therefore the stage-0 one, 16 B/param, divided by the world size for everything (ZeRO-3-like).
fp16 is not run under FSDP2 (it would need a sharded grad scaler; not comparable to DeepSpeed's loss scaler).
``spec["offload"]`` passes ``CPUOffloadPolicy(pin_memory=True)`` (unpinned on a CPU-only machine) to every
``fully_shard`` call (sharded fp32 parameters, gradients and the AdamW step on the CPU). A model built on the meta
device (S3 at N > 1, so the full model never exists on the rank) is materialised after sharding with ``to_empty``
and a random normal fill.
:func:`layer_unsharded` is the S3 probe: does an FSDP2 unit hold unsharded (gathered) parameters right now?
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from _harness import TorchLoopTrainer, device


def _materialise(model: nn.Module, where: torch.device) -> None:
    """Allocate a meta-built, already sharded model on ``where`` (local shards only) and fill it randomly."""
    model.to_empty(device=where)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.normal_(0.0, 0.02)


def layer_unsharded(module: nn.Module) -> bool:
    """True when an FSDP2 unit (a module given to ``fully_shard``) holds unsharded parameters or a pending
    all-gather: reads the unit's parameter group(s) state (``FSDPParamGroup.is_sharded`` and its all-gather result),
    torch-internal names, so a caller must treat an exception as "probe unavailable"."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = state._fsdp_param_group
        groups = [] if group is None else [group]
    return any((not g.is_sharded) or g._all_gather_result is not None for g in groups)


class FSDP2Trainer(TorchLoopTrainer):
    """``fully_shard`` on every transformer block and then on the root; same ``loss/backward/step`` protocol."""

    name = "fsdp2"

    def __init__(self, model: torch.nn.Module, spec: dict) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if spec.get("dtype", "bf16") != "bf16":
            raise ValueError("the FSDP2 baseline runs bf16 only (fp16 would need ShardedGradScaler)")
        kw: dict[str, Any] = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        self.offload = bool(spec.get("offload"))
        if self.offload:
            from torch.distributed.fsdp import CPUOffloadPolicy

            # Pinned host memory needs an accelerator; a CPU smoke test runs the same path unpinned.
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        for block in model.layers:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        if any(p.is_meta for p in model.parameters()):
            _materialise(model, torch.device("cpu") if self.offload else device())
        super().__init__(model, spec)

    def info(self) -> dict[str, Any]:
        where = "on the CPU (CPUOffloadPolicy, pinned)" if self.offload else ""
        return {"optimizer_class": f"torch.optim.AdamW(fused) on FSDP2 fp32 shards {where}".strip(), "skipped_steps": 0}
