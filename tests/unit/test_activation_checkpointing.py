"""deepspeed.checkpointing on one process: parity with plain autograd, RNG replay, configure precedence.

Parity tests run the same function twice from the same RNG state, once plain and once checkpointed, and compare
outputs and every gradient exactly; dropout makes a recompute that draws different masks fail them.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

from deepspeed._core.engine import activation_checkpoint as core
from deepspeed.runtime.activation_checkpointing import checkpointing as ck
from deepspeed.runtime.config import DeepSpeedConfig


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> core.ActivationCheckpointState:
    """Each test gets its own process-wide state, so settings and tracker streams never leak between tests."""
    state = core.ActivationCheckpointState()
    monkeypatch.setattr(core, "_STATE", state)
    return state


class Block(torch.nn.Module):
    """Linear → dropout on the default stream → linear → dropout on the model-parallel tracker stream."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.a(x)))
        with ck.get_cuda_rng_tracker().fork():
            return self.drop(self.b(h))


def _grads(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out


def _run_twice(step: Callable[[bool], Any], leaves: list[torch.Tensor]) -> tuple[Any, Any, list, list]:
    """Run ``step(checkpointed)`` plain then checkpointed from identical RNG state; return outputs and grads."""
    ck.model_parallel_cuda_manual_seed(1234)
    plain_out = step(False)
    plain_grads = _grads(leaves)
    ck.model_parallel_cuda_manual_seed(1234)
    ckpt_out = step(True)
    return plain_out, ckpt_out, plain_grads, _grads(leaves)


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x, y)


# ---------------------------------------------------------------------- parity
def test_checkpoint_matches_plain_with_dropout_and_tracker() -> None:
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([Block(), Block()])
    x = torch.randn(5, 6, requires_grad=True)
    leaves = [x, *blocks.parameters()]

    def step(use_ckpt: bool) -> torch.Tensor:
        h = x
        for blk in blocks:
            h = ck.checkpoint(blk, h) if use_ckpt else blk(h)
        h.square().sum().backward()
        return h.detach()

    plain, ckpt, g_plain, g_ckpt = _run_twice(step, leaves)
    assert torch.equal(plain, ckpt)
    assert (plain == 0).any(), "dropout should have zeroed something, or the test proves nothing"
    _assert_same(g_plain, g_ckpt)


def test_recompute_restores_rng_streams_afterwards() -> None:
    """Backward's recomputation must not shift the default or tracker streams seen by later code."""
    blk = Block()
    x = torch.randn(3, 6, requires_grad=True)
    ck.model_parallel_cuda_manual_seed(7)
    ck.checkpoint(blk, x).sum().backward()
    after_ckpt = (torch.rand(4), _draw_tracker())
    ck.model_parallel_cuda_manual_seed(7)
    blk(x).sum().backward()
    after_plain = (torch.rand(4), _draw_tracker())
    assert torch.equal(after_ckpt[0], after_plain[0]) and torch.equal(after_ckpt[1], after_plain[1])


def _draw_tracker() -> torch.Tensor:
    with ck.get_cuda_rng_tracker().fork():
        return torch.rand(4)


def test_keyword_tensor_and_non_tensor_args() -> None:
    lin = torch.nn.Linear(4, 4)
    drop = torch.nn.Dropout(0.3)
    x = torch.randn(3, 4, requires_grad=True)
    bias = torch.randn(4, requires_grad=True)

    def fn(inp: torch.Tensor, scale: float, mode: str, *, bias: torch.Tensor, power: int = 1) -> torch.Tensor:
        assert mode == "train"
        return (drop(lin(inp)) * scale + bias) ** power

    def step(use_ckpt: bool) -> torch.Tensor:
        call = ck.checkpoint if use_ckpt else (lambda f, *a, **k: f(*a, **k))
        out = call(fn, x, 1.5, "train", bias=bias, power=2)
        out.sum().backward()
        return out.detach()

    plain, ckpt, g_plain, g_ckpt = _run_twice(step, [x, bias, *lin.parameters()])
    assert torch.equal(plain, ckpt)
    _assert_same(g_plain, g_ckpt)
    assert g_ckpt[1].abs().sum() > 0, "the keyword tensor must receive a gradient"


def test_tuple_outputs_with_non_tensors_keep_their_structure() -> None:
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)

    def fn(inp: torch.Tensor) -> tuple:
        y = lin(inp)
        return y, "meta", (y.sum(), torch.tensor([1, 2])), {"z": y * 3}

    def step(use_ckpt: bool) -> tuple:
        out = ck.checkpoint(fn, x) if use_ckpt else fn(x)
        (out[0].square().sum() + out[2][0] + out[3]["z"].sum()).backward()
        return out

    plain, ckpt, g_plain, g_ckpt = _run_twice(step, [x, *lin.parameters()])
    assert ckpt[1] == "meta" and isinstance(ckpt[2], tuple) and set(ckpt[3]) == {"z"}
    assert ckpt[2][1].dtype == torch.int64 and not ckpt[2][1].requires_grad
    assert torch.equal(plain[0], ckpt[0]) and torch.equal(plain[3]["z"], ckpt[3]["z"])
    _assert_same(g_plain, g_ckpt)


def test_single_tensor_output_is_returned_as_a_tensor() -> None:
    x = torch.randn(3, requires_grad=True)
    out = ck.checkpoint(torch.sin, x)
    assert torch.is_tensor(out) and out.grad_fn is not None
    out.sum().backward()
    assert torch.allclose(x.grad, torch.cos(x.detach()))


def test_checkpoint_without_grad_just_calls_the_function(fresh_state: core.ActivationCheckpointState) -> None:
    with torch.no_grad():
        out = ck.checkpoint(torch.sin, torch.ones(2))
    assert out.grad_fn is None and fresh_state.pending_backwards == 0


def test_reentrant_checkpoint_rejects_autograd_grad() -> None:
    x = torch.randn(3, requires_grad=True)
    out = ck.checkpoint(torch.sin, x)
    with pytest.raises(RuntimeError, match="backward"):
        torch.autograd.grad(out.sum(), x)


def test_non_reentrant_matches_plain_with_dropout_and_tracker() -> None:
    torch.manual_seed(1)
    blk = Block()
    x = torch.randn(4, 6, requires_grad=True)

    def step(use_ckpt: bool) -> torch.Tensor:
        out = ck.non_reentrant_checkpoint(blk, x) if use_ckpt else blk(x)
        out.square().sum().backward()
        return out.detach()

    plain, ckpt, g_plain, g_ckpt = _run_twice(step, [x, *blk.parameters()])
    assert torch.equal(plain, ckpt)
    _assert_same(g_plain, g_ckpt)


def test_non_reentrant_supports_autograd_grad() -> None:
    x = torch.randn(3, requires_grad=True)
    (grad,) = torch.autograd.grad(ck.non_reentrant_checkpoint(torch.sin, x).sum(), x)
    assert torch.allclose(grad, torch.cos(x.detach()))


# ---------------------------------------------------------------------- RNG tracker and seeding
def test_tracker_add_fork_and_state_roundtrip() -> None:
    tracker = ck.CudaRNGStatesTracker()
    tracker.add("s", 11)
    with pytest.raises(ValueError, match="seed"):
        tracker.add("other", 11)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("s", 12)
    with pytest.raises(KeyError), tracker.fork("missing"):
        pass
    default_before = torch.get_rng_state()
    saved = tracker.get_states()
    with tracker.fork("s"):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), default_before), "fork must restore the caller's generator"
    torch.manual_seed(11)
    assert torch.equal(first, torch.rand(3)), "stream 's' must start from seed 11"
    tracker.set_states(saved)
    with tracker.fork("s"):
        assert torch.equal(torch.rand(3), first)
    tracker.reset()
    assert tracker.get_states() == {} and tracker.seeds_ == set()


class _TensorMpu:
    def get_tensor_model_parallel_rank(self) -> int:
        return 1

    def get_tensor_model_parallel_world_size(self) -> int:
        return 4

    def get_tensor_model_parallel_group(self) -> str:
        return "tp-group"

    def get_data_parallel_world_size(self) -> int:
        return 1


class _LegacyMpu:
    def get_model_parallel_rank(self) -> int:
        return 2

    def get_model_parallel_world_size(self) -> int:
        return 3

    def get_model_parallel_group(self) -> str:
        return "mp-group"


def test_mpu_of_either_naming_is_understood() -> None:
    assert core.model_parallel_view(_TensorMpu()) == core.ModelParallelView(1, 4, "tp-group")
    assert core.model_parallel_view(_LegacyMpu()) == core.ModelParallelView(2, 3, "mp-group")
    assert core.model_parallel_view(None) == core.ModelParallelView(0, 1, None)


def test_model_parallel_seeds_depend_on_tp_rank() -> None:
    ck.configure(_LegacyMpu())
    ck.model_parallel_cuda_manual_seed(100)
    default = torch.rand(2)
    torch.manual_seed(100)
    assert torch.equal(default, torch.rand(2))
    with ck.get_cuda_rng_tracker().fork():
        stream = torch.rand(2)
    torch.manual_seed(100 + 2718 + 2)
    assert torch.equal(stream, torch.rand(2))
    position = torch.get_rng_state()
    ck.model_parallel_reconfigure_tp_seed(5)
    assert torch.equal(torch.get_rng_state(), position), "reseeding the TP stream must not move the default one"
    with ck.get_cuda_rng_tracker().fork():
        stream = torch.rand(2)
    torch.manual_seed(5 + 2718 + 2)
    assert torch.equal(stream, torch.rand(2))


# ---------------------------------------------------------------------- configure
def _config(**block: Any) -> dict:
    return {"train_batch_size": 1, "activation_checkpointing": block}


def test_configure_precedence_defaults_config_kwargs(tmp_path: Any) -> None:
    assert not ck.is_configured()
    ck.configure(None)
    assert ck.is_configured()
    assert core.current_state().policy == core.CheckpointPolicy()
    cfg = _config(
        partition_activations=True,
        cpu_checkpointing=True,
        number_checkpoints=4,
        synchronize_checkpoint_boundary=True,
        profile=False,
    )
    ck.configure(None, deepspeed_config=cfg, checkpoint_in_cpu=False, profile=True)
    assert core.current_state().policy == core.CheckpointPolicy(
        partition_activations=True, num_checkpoints=4, checkpoint_in_cpu=False, synchronize=True, profile=True
    )
    assert ck.PARTITION_ACTIVATIONS and not ck.CPU_CHECKPOINT and ck.num_layers == 4 and ck.PROFILE_TIME
    # A second configure starts again from the defaults: nothing of the previous call survives.
    ck.configure(None, deepspeed_config=_config(profile=True))
    assert core.current_state().policy == core.CheckpointPolicy(profile=True)


def test_configure_accepts_path_and_deepspeed_config(tmp_path: Any) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_config(cpu_checkpointing=True)))
    ck.configure(None, deepspeed_config=str(path))
    assert core.current_state().policy.checkpoint_in_cpu
    ck.configure(_TensorMpu(), deepspeed_config=DeepSpeedConfig(_config(partition_activations=True)))
    assert core.current_state().policy.partition_activations and ck.mpu is not None
    with pytest.raises(TypeError, match="deepspeed_config"):
        ck.configure(None, deepspeed_config=42)


def test_contiguous_requires_partition_and_count() -> None:
    with pytest.raises(ValueError, match="partition_activations"):
        ck.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
    with pytest.raises(ValueError, match="partition_activations"):
        ck.configure(None, deepspeed_config=_config(contiguous_memory_optimization=True, number_checkpoints=2))
    with pytest.raises(ValueError, match="number_checkpoints"):
        ck.configure(None, partition_activations=True, contiguous_checkpointing=True)
    ck.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
    assert ck.CONTIGUOUS_CHECKPOINTING


def test_toggles_and_reset(fresh_state: core.ActivationCheckpointState) -> None:
    ck.set_num_layers(6)
    assert ck.num_layers == 6
    ck.partition_activations_in_checkpoint(True)
    assert ck.PARTITION_ACTIVATIONS
    fresh_state.pending_backwards = 3
    ck.reset()
    assert fresh_state.pending_backwards == 0 and fresh_state.arena.buffers == {}


def test_world_of_one_keeps_inputs_whole(fresh_state: core.ActivationCheckpointState) -> None:
    """Without a model-parallel group nothing is split or copied: the input itself is what backward uses."""
    ck.configure(None, partition_activations=True)
    made: list[torch.Tensor] = []
    fresh_state.observers.append(made.append)
    x = torch.randn(4, requires_grad=True)
    ck.checkpoint(torch.sin, x).sum().backward()
    assert made == [] and torch.allclose(x.grad, torch.cos(x.detach()))


def test_contiguous_arena_overflow_names_the_setting() -> None:
    arena = core.ContiguousArena()
    arena.take(0, 3, torch.float32, torch.device("cpu"), 2)
    arena.take(0, 3, torch.float32, torch.device("cpu"), 2)
    with pytest.raises(RuntimeError, match="number_checkpoints"):
        arena.take(0, 3, torch.float32, torch.device("cpu"), 2)
    arena.rewind()
    assert arena.take(0, 3, torch.float32, torch.device("cpu"), 2).data_ptr() == arena.buffers[0].data_ptr()


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_inner_activations_are_not_kept_between_forward_and_backward(mode: str) -> None:
    """An activation the function saves for backward must be gone after a checkpointed forward (kept when plain)."""
    refs: list[Any] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        inner = x.exp()
        refs.append(weakref.ref(inner))
        return inner.sin()  # sin saves its input, `inner`, for backward

    x = torch.randn(4, requires_grad=True)
    call = ck.checkpoint if mode == "reentrant" else ck.non_reentrant_checkpoint
    out = call(fn, x)
    assert refs[0]() is None
    out.sum().backward()
    assert torch.allclose(x.grad, torch.exp(x.detach()) * torch.cos(torch.exp(x.detach())))
    plain = fn(x)
    assert refs[-1]() is not None, "control: without checkpointing the inner activation is kept"
    del plain


def test_non_reentrant_rejects_second_backward_clearly() -> None:
    x = torch.randn(3, requires_grad=True)
    out = ck.non_reentrant_checkpoint(lambda t: t.exp().exp(), x).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        out.backward()


def test_profile_records_phase_times(fresh_state: core.ActivationCheckpointState) -> None:
    ck.configure(None, profile=True, synchronize=True)
    x = torch.randn(3, requires_grad=True)
    ck.checkpoint(torch.sin, x).sum().backward()
    assert set(fresh_state.timings) == {"forward", "recompute", "backward"}
    assert all(v >= 0.0 for v in fresh_state.timings.values())
