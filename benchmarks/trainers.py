"""Which trainer a benchmark row runs: ours or upstream DeepSpeed (``DeepSpeedTrainer``) or PyTorch FSDP2.

Kept apart from ``_harness`` so that the baselines, which build on the harness, are imported only from here.
"""

from __future__ import annotations

from typing import Any

import torch

from _harness import DTYPES, DeepSpeedTrainer, Trainer, device
from baselines.fsdp2 import FSDP2Trainer
from models import MODELS, build_model


def make_trainer(model_name: str, spec: dict) -> tuple[Trainer, Any, int]:
    """Build the model on the device and wrap it; returns (trainer, model config, parameter count)."""
    dev = device()
    if spec["impl"] == "fsdp2":
        model = build_model(model_name, dev, torch.float32)  # FSDP2 keeps fp32 params; bf16 compute
        n = sum(p.numel() for p in model.parameters())
        return FSDP2Trainer(model, spec), MODELS[model_name], n
    model = build_model(model_name, dev, DTYPES[spec.get("dtype", "bf16")])
    n = sum(p.numel() for p in model.parameters())
    return DeepSpeedTrainer(model, spec), MODELS[model_name], n
