"""Ulysses sequence parallelism for Hugging Face attention.

[Note: Ulysses exchange] Each rank of a sequence-parallel (SP) group of size ``ws`` holds ``seq / ws`` consecutive
tokens of the same samples. Everything but attention is per-token, so it runs on the shard unchanged. Attention
needs every token: before it, one all-to-all turns ``[seq/ws tokens, all heads]`` into ``[all tokens, heads/ws]``
(each rank sends head block ``j`` of its tokens to rank ``j``), the model's own attention kernel (the "core"
attention: sdpa, flash, eager, ...) runs on whole sequences for its block of heads, and the inverse all-to-all
returns ``[seq/ws tokens, all heads]``. The exchange is differentiable, so backward runs the same two exchanges.

Grouped-query attention: with ``kv_heads`` divisible by ``ws`` each rank gets ``kv_heads / ws`` key/value heads. With
fewer key/value heads than ranks (``ws % kv_heads == 0``) each key/value head is repeated ``ws / kv_heads`` times
first, so every rank gets exactly the one its query heads use (query head ``q`` uses key/value head
``q // (heads / kv_heads)``; rank ``r`` holds query heads ``[r*heads/ws, (r+1)*heads/ws)``).

Masks: the exchanged attention runs on the whole sequence, so the model's local mask does not apply. Kernels that
are causal on their own when given no mask (sdpa, flash) get none; an ``eager`` core gets a causal mask built for the
whole sequence here, since eager attention is causal only through its mask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from deepspeed._core.comm import dist
from deepspeed._core.comm.collectives import gather_list
from deepspeed._core.sequence.exchange import dim_zero_all_to_all, register_all_to_all_group

EAGER = "eager"


def head_layout_problem(attn_head_count: int, kv_head_count: int, world_size: int) -> str | None:
    """Why ``world_size`` SP ranks cannot split these heads (``None`` when they can); local, no communication."""
    if attn_head_count % world_size:
        return (
            f"the number of attention heads ({attn_head_count}) must be divisible by the sequence parallel size "
            f"({world_size})"
        )
    if kv_head_count % world_size and world_size % kv_head_count:
        return (
            f"the number of key/value heads ({kv_head_count}) and the sequence parallel size ({world_size}) must "
            "divide one another"
        )
    return None


def _seq_first(x: torch.Tensor) -> torch.Tensor:
    return x.permute(2, 0, 1, 3)  # [bs, heads, seq, hd] -> [seq, bs, heads, hd]


class UlyssesSPAttentionHF(torch.nn.Module):
    """Wraps a Hugging Face core attention function so it runs sequence-parallel over ``process_group``.

    Inputs are this rank's sequence shard, ``[bs, heads, seq_local, head_dim]``; the output is
    ``([bs, seq_local, heads * head_dim], attention weights)`` as the model's attention expects. See
    [Note: Ulysses exchange]. ``position_ids`` must be passed (the model passes them through when called with
    them); they are gathered over the group for the core attention.
    """

    def __init__(
        self,
        attn: Callable[..., Any],
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group: Any,
        seq_length_is_variable: bool = False,
        local_seq_length: int | None = None,
        global_seq_length: int | None = None,
        disable_in_eval: bool = False,
    ) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = dist.get_world_size(group=process_group)
        self.sp_rank = dist.get_rank(group=process_group)
        problem = head_layout_problem(attn_head_count, kv_head_count, self.world_size)
        if problem is not None:
            raise ValueError(problem)
        self.batch_size, self.num_hidden_layers = batch_size, num_hidden_layers
        self.attn_head_count, self.attn_head_size = attn_head_count, attn_head_size
        self.global_kv_head_count = kv_head_count
        self.seq_length_is_variable, self.disable_in_eval = seq_length_is_variable, disable_in_eval
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.local_q_head_count = attn_head_count // self.world_size
        self.kv_replication = max(1, self.world_size // kv_head_count)
        self.local_kv_head_count = max(1, kv_head_count // self.world_size)
        self.core_attn_implementation: str | None = None
        self.skip_all_but_last_attention_debug_mode = False
        self._group_name = register_all_to_all_group(process_group)
        if not seq_length_is_variable and local_seq_length is not None:
            self._set_required_shapes(local_seq_length, batch_size)

    def _set_required_shapes(self, local_seq: int, batch: int) -> None:
        hd = self.attn_head_size
        self.required_query_shape = torch.Size([local_seq, batch, self.attn_head_count, hd])
        self.required_key_value_shape = torch.Size([local_seq, batch, self.global_kv_head_count, hd])
        self.required_context_shape = torch.Size([local_seq * self.world_size, batch, self.local_q_head_count, hd])

    # --- the exchange ------------------------------------------------------------------------------------------
    def _scatter_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[seq_l, bs, H, hd]`` -> ``[bs, H/ws, seq, hd]``: whole sequences for this rank's block of heads."""
        seq_l, bs, heads, hd = x.shape
        ws = self.world_size
        blocks = x.reshape(seq_l, bs, ws, heads // ws, hd).permute(2, 0, 1, 3, 4)
        received = dim_zero_all_to_all(self.process_group, blocks)  # [ws (source rank = seq block), seq_l, ...]
        return received.reshape(ws * seq_l, bs, heads // ws, hd).permute(1, 2, 0, 3)

    def _gather_heads(self, context: torch.Tensor) -> torch.Tensor:
        """Core output ``[bs, seq, H/ws, hd]`` -> ``[bs, seq_l, H * hd]`` for this rank's tokens."""
        bs, seq, local_heads, hd = context.shape
        ws = self.world_size
        blocks = context.permute(1, 0, 2, 3).reshape(ws, seq // ws, bs, local_heads, hd)
        received = dim_zero_all_to_all(self.process_group, blocks)  # [ws (source rank = head block), seq_l, ...]
        return received.permute(2, 1, 0, 3, 4).reshape(bs, seq // ws, ws * local_heads * hd)

    def _gather_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(position_ids) for _ in range(self.world_size)]
        gather_list(parts, position_ids.contiguous(), self.process_group)
        return torch.cat(parts, dim=1)

    def _check_shapes(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        heads, kv, hd = self.attn_head_count, self.global_kv_head_count, self.attn_head_size
        if query.dim() != 4 or (query.shape[1], query.shape[3]) != (heads, hd):
            raise ValueError(f"query has shape {tuple(query.shape)}; expected [batch, {heads}, seq, {hd}]")
        if key.shape != value.shape or (key.shape[1], key.shape[3]) != (kv, hd):
            raise ValueError(
                f"key/value have shapes {tuple(key.shape)}, {tuple(value.shape)}; expected [batch, {kv}, seq, {hd}]"
            )
        if not self.seq_length_is_variable and self.local_seq_length not in (None, query.shape[2]):
            raise ValueError(
                f"the local sequence length is {query.shape[2]} but {self.local_seq_length} was registered "
                "(seq_length_is_variable=False); register with seq_length_is_variable=True for varying lengths"
            )

    def forward(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        """Attention of this rank's tokens against the whole sequence, via the exchange."""
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        if kwargs.get("position_ids") is None:
            raise ValueError(
                "UlyssesSPAttentionHF needs position_ids: call the model with position_ids of each rank's shard "
                "(UlyssesSPDataLoaderAdapter provides them)"
            )
        self._check_shapes(query, key, value)
        kwargs["position_ids"] = self._gather_positions(kwargs["position_ids"])
        if self.kv_replication > 1:
            key = key.repeat_interleave(self.kv_replication, dim=1)
            value = value.repeat_interleave(self.kv_replication, dim=1)
            module.num_key_value_groups = self.local_q_head_count // self.local_kv_head_count  # type: ignore[assignment]
        q = self._scatter_heads(_seq_first(query))
        k = self._scatter_heads(_seq_first(key))
        v = self._scatter_heads(_seq_first(value))
        if attention_mask is None and self.core_attn_implementation == EAGER:
            attention_mask = _causal_mask(q.shape[2], q.dtype, q.device)
        context, weights = self.attn(module, q, k, v, attention_mask, *args, **kwargs)
        return self._gather_heads(context), weights


def _causal_mask(seq: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive ``[1, 1, seq, seq]`` mask: each token attends to itself and the tokens before it."""
    blocked = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)
    mask = torch.zeros(seq, seq, dtype=dtype, device=device).masked_fill(blocked, torch.finfo(dtype).min)
    return mask[None, None]


# ---------------------------------------------------------------------- Hugging Face registration
_MIN_TRANSFORMERS = "4.51.3"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise ImportError(
            "UlyssesSPAttentionHF.register_with_transformers needs the 'transformers' package (pip install "
            f"'transformers>={_MIN_TRANSFORMERS}')"
        ) from err
    from packaging.version import Version

    if Version(transformers.__version__) < Version(_MIN_TRANSFORMERS):
        raise ValueError(
            f"UlyssesSPAttentionHF needs transformers>={_MIN_TRANSFORMERS}; installed: {transformers.__version__}"
        )
    return transformers


def _model_config(model_name_or_path: Any, core_attn_implementation: str) -> Any:
    """The model's config; a loaded model must already use ``core_attn_implementation``."""
    config = getattr(model_name_or_path, "config", None)
    if config is None:
        return _transformers().AutoConfig.from_pretrained(model_name_or_path)
    current = getattr(config, "_attn_implementation", None)
    if current is not None and current != core_attn_implementation:
        raise ValueError(
            f"the model was loaded with attn_implementation={current!r} but core_attn_implementation="
            f"{core_attn_implementation!r} was requested; load the model with attn_implementation="
            f"{core_attn_implementation!r}"
        )
    return config


def _core_attention(model: Any, name: str) -> Callable[..., Any]:
    """The attention function the model would call for ``name``, before it is replaced by the SP wrapper."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == EAGER:
        # Models call their own module's eager function when the registry has no "eager" entry.
        import sys

        own = getattr(sys.modules.get(type(model).__module__), "eager_attention_forward", None)
        if own is None:
            from transformers.models.llama.modeling_llama import eager_attention_forward as own
        return cast(Callable[..., Any], own)
    if name.startswith("paged|"):
        raise ValueError(f"core_attn_implementation={name!r}: paged attention cannot run sequence parallel")
    if "/" in name:  # a hub kernel "org/name[@rev][:fn]"
        from transformers.modeling_flash_attention_utils import lazy_import_flash_attention

        lazy_import_flash_attention(name)
    if name not in ALL_ATTENTION_FUNCTIONS:
        valid = sorted([EAGER, *ALL_ATTENTION_FUNCTIONS.keys()])
        raise ValueError(f"core_attn_implementation={name!r} is not a registered attention; valid: {valid}")
    # A second registration in the same process wraps the original kernel, not the first wrapper.
    return getattr(ALL_ATTENTION_FUNCTIONS[name], "_ulysses_core", ALL_ATTENTION_FUNCTIONS[name])


def _head_counts(config: Any) -> tuple[int, int, int, int]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    return heads, int(head_dim), int(kv), int(text.num_hidden_layers)


def register_with_transformers(
    cls: type[UlyssesSPAttentionHF],
    model_name_or_path: Any,
    core_attn_implementation: str,
    sequence_parallel_size: int,
    micro_batch_size: int,
    seq_length: int | None = None,
    seq_length_is_variable: bool = True,
    disable_in_eval: bool = False,
    max_length: int | None = None,
) -> Any:
    """Make every attention call of ``core_attn_implementation`` sequence-parallel; returns the SP mpu module.

    Checks run on every rank before the SP groups are created, so a bad setting raises everywhere and never
    leaves a rank waiting in a collective.
    """
    from deepspeed._core.sequence import groups
    from deepspeed._foundation.logging import logger

    if sequence_parallel_size == 1:
        return None
    if max_length is not None:
        logger.warning("register_with_transformers: max_length is deprecated; use seq_length")
        seq_length = max_length if seq_length is None else seq_length
    if not seq_length_is_variable and seq_length is None:
        raise ValueError("seq_length_is_variable=False needs seq_length (the global sequence length)")
    _transformers()
    problem = groups.sequence_parallel_problem(sequence_parallel_size, dist.get_world_size())
    if problem is not None:
        raise RuntimeError(problem)
    config = _model_config(model_name_or_path, core_attn_implementation)
    heads, head_dim, kv, layers = _head_counts(config)
    problem = head_layout_problem(heads, kv, sequence_parallel_size)
    if problem is not None:
        raise ValueError(problem)
    if seq_length is not None and seq_length % sequence_parallel_size:
        raise ValueError(
            f"seq_length={seq_length} must be divisible by sequence_parallel_size={sequence_parallel_size}"
        )
    core = _core_attention(model_name_or_path, core_attn_implementation)
    groups.ensure_sequence_parallel(sequence_parallel_size, asked_by="register_with_transformers")
    local = None if seq_length is None else seq_length // sequence_parallel_size
    wrapper = cls(
        attn=core,
        batch_size=micro_batch_size,
        attn_head_count=heads,
        attn_head_size=head_dim,
        kv_head_count=kv,
        num_hidden_layers=layers,
        process_group=groups.get_sequence_parallel_group(),
        seq_length_is_variable=seq_length_is_variable,
        local_seq_length=local,
        global_seq_length=seq_length,
        disable_in_eval=disable_in_eval,
    )
    wrapper.core_attn_implementation = core_attn_implementation
    _install(wrapper, core_attn_implementation)
    # The groups module is the mpu (deepspeed.runtime.sequence_parallel.parallel_state_sp re-exports it).
    return groups


def _install(wrapper: UlyssesSPAttentionHF, name: str) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def sequence_parallel_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        # The model's mask covers its local tokens only; the wrapper attends over the whole sequence.
        mask = attention_mask if type(attention_mask).__name__ == "BlockMask" else None
        return wrapper(module, query, key, value, mask, *args, **kwargs)

    sequence_parallel_attention._ulysses_core = wrapper.attn  # type: ignore[attr-defined]
    ALL_ATTENTION_FUNCTIONS[name] = sequence_parallel_attention


UlyssesSPAttentionHF.register_with_transformers = classmethod(register_with_transformers)  # type: ignore[attr-defined]
