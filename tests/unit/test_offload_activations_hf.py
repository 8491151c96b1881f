"""The hidden-states offload context manager on a tiny Hugging Face Llama with gradient checkpointing."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from deepspeed.runtime.activation_checkpointing import offload_activations as oa  # noqa: E402

LAYERS = 3


def _model() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _grads(model: torch.nn.Module, manager: oa.CheckpointHiddenStatesOffload | None) -> list[torch.Tensor]:
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    with manager if manager is not None else torch.enable_grad():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def test_offload_gives_identical_gradients_and_moves_all_but_the_last_layer_input() -> None:
    model = _model()
    expected = _grads(model, None)
    layer_class = transformers.modeling_layers.GradientCheckpointingLayer
    original_call = layer_class.__call__
    manager = oa.get_checkpoint_hidden_states_offloading_ctx_manager(min_offload_bytes=0)
    for _ in range(2):  # the second step reuses the pool
        got = _grads(model, manager)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    stats = manager.stats
    assert stats.marked_tensors == 2 * LAYERS
    assert stats.offloaded_tensors == stats.restored_tensors == 2 * (LAYERS - 1)
    assert stats.kept_last_tensors == 2
    assert stats.offloaded_bytes == 2 * (LAYERS - 1) * 2 * 12 * 32 * 4
    assert stats.saved_tensors_seen > stats.marked_tensors
    assert len(manager.offloader.pool.buffers) <= LAYERS - 1
    assert layer_class.__call__ is original_call  # the marker is removed when the last manager exits


def test_small_tensors_stay_and_bad_arguments_are_refused() -> None:
    model = _model()
    manager = oa.get_checkpoint_hidden_states_offloading_ctx_manager(min_offload_bytes=1 << 20)
    _grads(model, manager)
    assert manager.stats.offloaded_tensors == 0 and manager.stats.skipped_marked_tensors == LAYERS
    with pytest.raises(ValueError, match="keep_last_count must be a non-negative integer, got -1"):
        oa.get_checkpoint_hidden_states_offloading_ctx_manager(keep_last_count=-1)
    with manager, pytest.raises(RuntimeError, match="already active"):
        manager.__enter__()
