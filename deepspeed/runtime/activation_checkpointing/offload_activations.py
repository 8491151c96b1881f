"""``deepspeed.runtime.activation_checkpointing.offload_activations``: offload checkpointed hidden states of
Hugging Face models to host memory.

Typical use with ``model.gradient_checkpointing_enable()``::

    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager,
    )

    offload = get_checkpoint_hidden_states_offloading_ctx_manager()
    for batch in loader:
        with offload:
            loss = engine(**batch).loss
            engine.backward(loss)
        engine.step()

While a manager is active, every ``transformers`` ``GradientCheckpointingLayer`` call in training marks its first
positional argument (the hidden states); the copy the checkpoint saves of it goes to a pooled host buffer and comes
back ahead of the layer's recomputation. The engine lives in :mod:`deepspeed._core.engine.activation_offload`.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from deepspeed._core.engine.activation_offload import (
    CheckpointActivationOffloadStats,
    CopyStreams,
    HostMemory,
    MarkedOffloadPolicy,
    MarkedTensorOffload,
)

__all__ = [
    "CheckpointActivationOffloadStats",
    "CheckpointHiddenStatesOffload",
    "get_checkpoint_hidden_states_offloading_ctx_manager",
    "patch_gradient_checkpointing_layer_marker",
]

_ActivationOffloadEngine = MarkedTensorOffload

_lock = threading.Lock()
_active: list[CheckpointHiddenStatesOffload] = []
_patched: dict[str, Any] = {}  # "cls" -> the layer class, "call" -> its original __call__


class CheckpointHiddenStatesOffload(_ActivationOffloadEngine, torch.autograd.graph.saved_tensors_hooks):
    """Context manager: saved-tensor hooks that offload marked tensors, plus the layer marker while active."""

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        min_offload_bytes: int = 1024,
        max_fwd_stash_count: int = 2,
        max_cpu_buffer_pool_count: int = 64,
        keep_last_count: int = 1,
    ) -> None:
        policy = MarkedOffloadPolicy(
            memory=HostMemory.PINNED if use_pin_memory else HostMemory.PAGEABLE,
            copies=CopyStreams.SIDE if use_streams else CopyStreams.COMPUTE,
            min_offload_bytes=min_offload_bytes,
            max_fwd_stash_count=max_fwd_stash_count,
            max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
            keep_last_count=keep_last_count,
        )
        MarkedTensorOffload.__init__(self, policy)
        torch.autograd.graph.saved_tensors_hooks.__init__(self, self.pack, self.unpack)
        self._entered = False

    def __enter__(self) -> CheckpointHiddenStatesOffload:  # type: ignore[override]  # `with ... as m` gets m
        if self._entered:
            raise RuntimeError("this CheckpointHiddenStatesOffload is already active; use one instance per block")
        self._entered = True
        _acquire_marker(self)
        torch.autograd.graph.saved_tensors_hooks.__enter__(self)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            torch.autograd.graph.saved_tensors_hooks.__exit__(self, *exc)
        finally:
            _release_marker(self)
            self._entered = False
            self.reset()


def get_checkpoint_hidden_states_offloading_ctx_manager(
    use_pin_memory: bool = True,
    use_streams: bool = True,
    min_offload_bytes: int = 1024,
    max_fwd_stash_count: int = 2,
    max_cpu_buffer_pool_count: int = 64,
    keep_last_count: int = 1,
) -> CheckpointHiddenStatesOffload:
    """A :class:`CheckpointHiddenStatesOffload`; wrap each step's forward and backward in it.

    Args:
        use_pin_memory: page-lock the host buffers (asynchronous copies need it).
        use_streams: copy on a side stream (overlapping compute) instead of the compute stream.
        min_offload_bytes: smaller marked tensors stay on the device.
        max_fwd_stash_count: device-to-host copies left in flight before compute waits for the oldest.
        max_cpu_buffer_pool_count: host buffers the pool may hold; beyond, tensors stay on the device.
        keep_last_count: the newest marked tensors that stay on the device (backward needs them first).
    """
    return CheckpointHiddenStatesOffload(
        use_pin_memory,
        use_streams,
        min_offload_bytes,
        max_fwd_stash_count,
        max_cpu_buffer_pool_count,
        keep_last_count,
    )


def _layer_class() -> Any:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError as err:
        raise RuntimeError(
            "patch_gradient_checkpointing_layer_marker needs transformers.modeling_layers.GradientCheckpointingLayer "
            "(transformers >= 4.52)"
        ) from err
    return GradientCheckpointingLayer


def patch_gradient_checkpointing_layer_marker() -> None:
    """Make ``GradientCheckpointingLayer`` calls mark their hidden states for every active manager (idempotent)."""
    with _lock:
        if "cls" in _patched:
            return
        cls = _layer_class()
        original = cls.__call__

        @functools.wraps(original)
        def marking_call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if args and torch.is_tensor(args[0]) and self.training and torch.is_grad_enabled():
                if getattr(self, "gradient_checkpointing", False):
                    for manager in list(_active):
                        manager.mark(args[0])
            return original(self, *args, **kwargs)

        cls.__call__ = marking_call
        _patched.update(cls=cls, call=original)


def _acquire_marker(manager: CheckpointHiddenStatesOffload) -> None:
    _active.append(manager)
    try:
        patch_gradient_checkpointing_layer_marker()
    except RuntimeError:
        pass  # without transformers' layer class only explicit mark() calls select tensors


def _release_marker(manager: CheckpointHiddenStatesOffload) -> None:
    with _lock:
        if manager in _active:
            _active.remove(manager)
        if not _active and "cls" in _patched:
            _patched["cls"].__call__ = _patched["call"]
            _patched.clear()
