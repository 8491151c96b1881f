"""Build ZeRO checkpoints by hand, in upstream DeepSpeed's exact on-disk layout, from a known model.

Used to test ``zero_to_fp32`` independently of any ZeRO optimizer implementation: the expected
output is simply the model's own fp32 tensors.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict

import torch
from torch import nn

from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum


class TiedFrozenNet(nn.Module):
    """Odd sizes, a tied head, a frozen layer, one persistent and one non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 5)
        self.frozen = nn.Linear(5, 7)
        self.mid = nn.Linear(7, 5)
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, 11, bias=False)
        self.head.weight = self.embed.weight
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))
        self.register_buffer("cache", torch.zeros(3), persistent=False)


def make_net(seed: int = 0) -> TiedFrozenNet:
    torch.manual_seed(seed)
    return TiedFrozenNet()


def param_groups(net: nn.Module) -> list[list[tuple[str, nn.Parameter]]]:
    """Two optimizer groups of trainable parameters (each tied parameter once)."""
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    return [named[:2], named[2:]]


def _model_state(net: nn.Module, groups: list, frozen_shapes: dict | None, fragments: dict | None) -> dict:
    return {
        "module": {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in net.state_dict().items()},
        "buffer_names": ["scale"],
        "optimizer": None,
        "param_shapes": [OrderedDict((n, p.shape) for n, p in g) for g in groups],
        "frozen_param_shapes": frozen_shapes,
        "frozen_param_fragments": fragments,
        "shared_params": {"head.weight": "embed.weight"},
        "ds_version": "0.19.6",
        "dp_world_size": 0,
        "mp_world_size": 1,
    }


def _optim_file(stage: int, world: int, payload: dict) -> dict:
    sd = {
        "zero_stage": ZeroStageEnum(stage),
        "loss_scaler": DynamicLossScaler(init_scale=2**8),
        "dynamic_loss_scale": True,
        "overflow": False,
        "partition_count": [world] * 2 if stage < 3 else world,
        **payload,
    }
    return {"optimizer_state_dict": sd, "ds_config": {}, "ds_version": "0.19.6"}


def write_stage12(
    root: str, net: nn.Module, stage: int, world: int, strip_padding: bool, tag: str = "global_step3"
) -> None:
    """One model file plus ``world`` optimizer files with ``single_partition_of_fp32_groups``."""
    tag_dir = os.path.join(root, tag)
    os.makedirs(tag_dir, exist_ok=True)
    groups = param_groups(net)
    partitions: list[list[torch.Tensor]] = [[] for _ in range(world)]
    paddings: list[list[int]] = [[] for _ in range(world)]
    for group in groups:
        flat = torch.cat([p.detach().float().reshape(-1) for _, p in group])
        padded_len = 2 * world * math.ceil(flat.numel() / (2 * world))  # upstream alignment
        pad = padded_len - flat.numel()
        flat = torch.cat([flat, torch.full((pad,), float("nan"))])  # padding must never be read
        size = padded_len // world
        for r in range(world):
            part = flat[r * size : (r + 1) * size].clone()
            rank_pad = max(0, (r + 1) * size - (padded_len - pad))
            if strip_padding and rank_pad:
                part = part[: size - rank_pad].clone()
            partitions[r].append(part)
            paddings[r].append(rank_pad)
    frozen = [(n, p) for n, p in net.named_parameters() if not p.requires_grad]
    shapes = OrderedDict((n, p.shape) for n, p in frozen) if stage == 2 else None
    frags = OrderedDict((n, p.detach().clone()) for n, p in frozen) if stage == 2 else None
    torch.save(_model_state(net, groups, shapes, frags), os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
    for r in range(world):
        payload = {
            "single_partition_of_fp32_groups": partitions[r],
            "group_paddings": paddings[r],
            "base_optimizer_state": {},
            "clip_grad": 1.0,
        }
        prefix = "bf16_" if r % 2 else ""  # both spellings occur in the wild; the reader accepts either
        name = f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        torch.save(_optim_file(stage, world, payload), os.path.join(tag_dir, name))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(tag)


def _share(t: torch.Tensor, world: int, r: int) -> torch.Tensor:
    """Rank ``r``'s ZeRO-3 partition of ``t``: ``ceil(numel/world)`` elements, zero padded at the end."""
    flat = t.detach().reshape(-1)
    share = math.ceil(flat.numel() / world)
    padded = torch.cat([flat, flat.new_zeros(share * world - flat.numel())])
    return padded[r * share : (r + 1) * share].clone()


def write_stage3(root: str, net: nn.Module, world: int, tag: str = "global_step3") -> None:
    """``world`` model files and ``world`` optimizer files with ``fp32_flat_groups`` (two sub-groups)."""
    tag_dir = os.path.join(root, tag)
    os.makedirs(tag_dir, exist_ok=True)
    groups = param_groups(net)
    frozen = [(n, p) for n, p in net.named_parameters() if not p.requires_grad]
    for r in range(world):
        flat_groups = [torch.cat([_share(p.float(), world, r) for _, p in g]) for g in groups]
        shapes = OrderedDict((n, p.shape) for n, p in frozen)
        frags = OrderedDict((n, _share(p, world, r)) for n, p in frozen)
        torch.save(
            _model_state(net, groups, shapes, frags),
            os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"),
        )
        torch.save(
            _optim_file(3, world, {"fp32_flat_groups": flat_groups}),
            os.path.join(tag_dir, f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"),
        )
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(tag)


def expected_state(net: nn.Module, include_frozen: bool) -> dict[str, torch.Tensor]:
    """What consolidation must return: fp32 trainable weights, frozen weights, persistent buffers, aliases."""
    out = {"scale": net.scale.float()}
    for name, p in net.named_parameters(remove_duplicate=False):
        if p.requires_grad or include_frozen:
            out[name] = p.detach().float()
    return out
