"""A tiny Hugging Face Llama and the helpers the sequence-parallel tests share."""

from __future__ import annotations

import torch

VOCAB, HIDDEN, HEADS, LAYERS = 64, 32, 4, 2


def tiny_llama(attn: str, kv_heads: int = HEADS, seed: int = 0, heads: int = HEADS) -> torch.nn.Module:
    """A 2-layer Llama (hidden 32 or a multiple of ``heads``, 4 heads) in fp32 with the given core attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN if heads == HEADS else 8 * heads,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        attn_implementation=attn,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def batch(seed: int, bs: int, seq: int) -> dict:
    """A batch as a data loader yields it: input_ids, position_ids, labels (a few labels masked)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (bs, seq), generator=g)
    labels = ids.clone()
    labels[:, :2] = -100
    return {"input_ids": ids, "position_ids": torch.arange(seq).expand(bs, seq).clone(), "labels": labels}


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """Labels shifted one token left with -100 after the last token (what the SP data-loader adapter does)."""
    return torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]


def loss_sum_and_count(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, shift_labels: torch.Tensor):
    """Summed token cross-entropy over the valid shifted labels, and their count."""
    logits = model(input_ids=ids, position_ids=pos).logits.float()
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return loss, (shift_labels != -100).sum()


class _GatherScalars(torch.autograd.Function):
    """Differentiable all-gather of one scalar per rank (backward: the summed gradient of this rank's entry).

    torch.distributed.nn's all_gather cannot be used: its backward scatters from global ranks, which fails in
    subgroups that do not start at rank 0.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as tdist

        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(tdist.get_world_size(group=group))]
        tdist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as tdist

        grad = grad.contiguous()
        tdist.all_reduce(grad, group=ctx.group)
        return grad[tdist.get_rank(group=ctx.group)], None


def sp_mean_loss(model: torch.nn.Module, micro: dict, group) -> torch.Tensor:
    """The sequence's mean token loss on every SP rank: loss sums gathered differentiably, as the HF Trainer does."""
    loss, count = loss_sum_and_count(model, micro["input_ids"], micro["position_ids"], micro["shift_labels"])
    sums = _GatherScalars.apply(loss, group)
    counts = _GatherScalars.apply(count.float(), group)
    return sums.sum() / counts.sum()
