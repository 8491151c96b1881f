"""PyTorch FSDP2 baseline: the same model under ``torch.distributed.fsdp.fully_shard``, one call per block.

Configuration (the usual FSDP2 recipe, chosen to match the DeepSpeed runs): fp32 sharded parameters, bf16
compute through ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, fp32 gradients, torch AdamW
(fused) on the fp32 shards, ``clip_grad_norm_(1.0)``, accumulation by plain repeated backward (gradients
reduced every micro-step, as FSDP2 does unless ``set_requires_gradient_sync(False)``). Its model-state floor is
therefore the stage-0 one, 16 B/param, divided by the world size for everything (ZeRO-3-like).
fp16 is not run under FSDP2 (it would need a sharded grad scaler; not comparable to DeepSpeed's loss scaler).
"""
from __future__ import annotations

from typing import Any

import torch
from _harness import Trainer, make_optimizer


class FSDP2Trainer(Trainer):
    """``fully_shard`` on every transformer block and then on the root; same ``loss/backward/step`` protocol."""

    name = "fsdp2"

    def __init__(self, model: torch.nn.Module, spec: dict) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if spec.get("dtype", "bf16") != "bf16":
            raise ValueError("the FSDP2 baseline runs bf16 only (fp16 would need ShardedGradScaler)")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        self.model = model
        self.gas = int(spec.get("gas", 1))
        self.optimizer = make_optimizer(model.parameters())
        self._micro = 0
        self.steps = 0

    def loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(ids, labels)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.gas).backward()

    def step(self) -> None:
        self._micro += 1
        if self._micro % self.gas:
            return
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1

    def info(self) -> dict[str, Any]:
        return {"optimizer_class": "torch.optim.AdamW(fused) on FSDP2 fp32 shards", "skipped_steps": 0}
