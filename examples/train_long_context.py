"""Train a small Hugging Face Llama at a long sequence with tiled MLP, tiled logits + loss and activation
checkpointing (optionally offloaded to host memory).

    deepspeed --num_gpus 2 examples/train_long_context.py --seq_len 4096 --zero_stage 3 --cpu_checkpointing

The model is built from a config (nothing is downloaded) and trained on a synthetic counting language. What each
switch saves is explained in docs/long_context.md:

* ``TiledMLP`` replaces every ``LlamaMLP.forward``: the ``[tokens, intermediate]`` activations exist one tile at a
  time (``--mlp_shards``, an integer or ``auto``);
* ``TiledFusedLogitsLoss`` computes the head and the cross-entropy tile by tile: the ``[tokens, vocab]`` logits
  never exist in full (``--loss_shards``);
* each decoder layer is checkpointed with ``deepspeed.checkpointing.checkpoint``; with ``--cpu_checkpointing`` the
  config's ``activation_checkpointing.cpu_checkpointing`` moves the layers' saved inputs to pinned host buffers;
* ``--sp N`` splits every sequence over N ranks (Ulysses sequence parallelism): attention is wrapped by
  ``UlyssesSPAttentionHF.register_with_transformers`` and ``UlyssesSPDataLoaderAdapter`` cuts each rank's batches
  into token shards; the loss is the sequence's mean token loss on every rank of the SP group.

Rank 0 prints the loss of every step; the exit status is non-zero if the loss is not finite, or (with 5 steps or
more) did not go down.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import types
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import deepspeed
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.sequence_parallel.ulysses_sp import (
    TiledFusedLogitsLoss,
    TiledMLP,
    UlyssesSPAttentionHF,
    UlyssesSPDataLoaderAdapter,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--micro_batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--zero_stage", type=int, default=3, choices=[0, 1, 2, 3])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--mlp_shards", default="4", help="tiles of the MLP: an integer or 'auto'")
    parser.add_argument("--loss_shards", default="8", help="tiles of the logits and loss: an integer or 'auto'")
    parser.add_argument("--cpu_checkpointing", action="store_true", help="offload checkpointed layer inputs")
    parser.add_argument("--sp", type=int, default=1, help="sequence-parallel ranks per sequence (divides the world)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    return parser.parse_args(argv)


def _shards(value: str) -> int | str:
    return value if value == "auto" else int(value)


def tiled_mlp_forward(shards: int | str) -> Any:
    """A ``LlamaMLP.forward`` replacement running the original forward through :class:`TiledMLP`."""

    def plain(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    def forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return TiledMLP.apply(plain, self, x, shards, list(self.parameters()))

    return forward


class TiledLossLlama(torch.nn.Module):
    """The Llama body, then the head and the next-token loss through :class:`TiledFusedLogitsLoss`."""

    def __init__(self, model: LlamaForCausalLM, loss_shards: int | str, sp_group: Any = None) -> None:
        super().__init__()
        self.model, self.lm_head, self.config = model.model, model.lm_head, model.config
        self.loss_shards, self.sp_group = loss_shards, sp_group

    @staticmethod
    def tile_loss(self: TiledLossLlama, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of one tile (ignored labels are -100)."""
        logits = self.lm_head(hidden).float()
        return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state
        # Next-token targets: shifted left, the last position ignored (as Ulysses data loaders' shift_labels).
        labels = F.pad(input_ids[:, 1:], (0, 1), value=-100) if shift_labels is None else shift_labels
        total = TiledFusedLogitsLoss.apply(
            TiledLossLlama.tile_loss, self, hidden, labels, None, self.loss_shards, [self.lm_head.weight], "sum"
        )
        count = (labels != -100).sum()
        if self.sp_group is not None:  # this rank holds a shard: the sequence's loss is the SP group's sum / count
            total = SumOverGroup.apply(total, self.sp_group)
            dist.all_reduce(count, group=self.sp_group)
        return total / count


class SumOverGroup(torch.autograd.Function):
    """Sum of one scalar over a process group. Each rank's loss is then the whole sequence's; the backward sums the
    ranks' incoming gradients, so that the engine's average over all ranks gives the exact gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def build_model(args: argparse.Namespace) -> tuple[TiledLossLlama, Any]:
    """The model and, with ``--sp`` > 1, the sequence-parallel mpu (else ``None``)."""
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 8 / 3),
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        layer.mlp.forward = types.MethodType(tiled_mlp_forward(_shards(args.mlp_shards)), layer.mlp)
    # Checkpoint every decoder layer through deepspeed.checkpointing, so its settings (cpu_checkpointing) apply.
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    for layer in model.model.layers:
        layer._gradient_checkpointing_func = deepspeed.checkpointing.checkpoint
    model.train()
    # Before the first forward: every attention call goes through the all-to-all exchange (None when sp == 1).
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=args.sp,
        micro_batch_size=args.micro_batch,
        seq_length_is_variable=True,
    )
    sp_group = mpu.get_sequence_parallel_group() if mpu is not None else None
    return TiledLossLlama(model, _shards(args.loss_shards), sp_group), mpu


def ds_config(args: argparse.Namespace) -> dict:
    config: dict = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": args.zero_stage},
        "activation_checkpointing": {"cpu_checkpointing": args.cpu_checkpointing},
    }
    if args.bf16:
        config["bf16"] = {"enabled": True}
    return config


def batch(step: int, rank: int, args: argparse.Namespace, device: str) -> torch.Tensor:
    """A counting sequence from a seeded random start: learnable, so the loss falls within a few steps."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    starts = torch.randint(0, args.vocab, (args.micro_batch, 1), generator=g)
    return ((starts + torch.arange(args.seq_len)) % args.vocab).to(device)


def batches(args: argparse.Namespace, rank: int, mpu: Any, device: str) -> Any:
    """The micro-batches of ``args.steps`` steps as keyword arguments of the model's forward. Under SP each rank
    brings its own sequences and the adapter hands every rank of the group its shard of each of them in turn."""
    if mpu is None:
        return ({"input_ids": batch(step, rank, args, device)} for step in range(args.steps))
    loader = []
    for step in range(math.ceil(args.steps / args.sp)):
        ids = batch(step, rank, args, "cpu")
        pos = torch.arange(args.seq_len).expand_as(ids).clone()
        loader.append({"input_ids": ids, "position_ids": pos, "labels": ids.clone()})
    adapter = UlyssesSPDataLoaderAdapter(
        loader,
        sp_rank=mpu.get_sequence_parallel_rank(),
        sp_group=mpu.get_sequence_parallel_group(),
        sp_world_size=mpu.get_sequence_parallel_world_size(),
        device=torch.device(device),
    )
    return ({k: v.to(device) for k, v in micro.items()} for _, micro in zip(range(args.steps), adapter, strict=False))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    config = ds_config(args)
    deepspeed.checkpointing.configure(None, deepspeed_config=config)  # before initialize: it checks the key
    model, mpu = build_model(args)
    engine, *_ = deepspeed.initialize(model=model, config=config, mpu=mpu)
    device, rank = get_accelerator().current_device_name(), dist.get_rank()
    losses = []
    for step, micro in enumerate(batches(args, rank, mpu, device)):
        loss = engine(**micro)
        engine.backward(loss)
        engine.step()
        deepspeed.checkpointing.reset()  # nothing is pending after a backward; keeps the offload pool tidy
        losses.append(float(loss.detach()))
        if rank == 0:
            print(f"step {step} loss {losses[-1]:.4f}", flush=True)
    engine.destroy()
    if mpu is not None:
        mpu._release_sequence_parallel_groups()  # so that a later run in this process can form its groups again
    if not all(math.isfinite(v) for v in losses):
        return 1
    if len(losses) >= 5 and not losses[-1] < losses[0]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
