"""Stepping a master through chunk views equals one plain step, for every optimizer we ship or accept."""

from __future__ import annotations

import pytest
import torch

from deepspeed._core.optim.chunked_step import step_in_chunks


def _optimizers() -> dict:
    from deepspeed.ops.adam import FusedAdam

    return {
        "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
        "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
        "SGD-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
        "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
        "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
    }


@pytest.mark.parametrize("name", list(_optimizers()))
@pytest.mark.parametrize("chunk", [1000, 300, 7])
def test_chunked_equals_plain(name: str, chunk: int) -> None:
    make = _optimizers()[name]
    torch.manual_seed(0)
    plain = torch.nn.Parameter(torch.randn(1000))
    chunked = torch.nn.Parameter(plain.detach().clone())
    opt_plain, opt_chunked = make([plain]), make([chunked])
    for _ in range(4):
        grad = torch.randn(1000).bfloat16()
        plain.grad = grad.float() * 0.5
        opt_plain.step()
        plain.grad = None
        step_in_chunks(opt_chunked, 0, grad, chunk, coef=0.5)
    torch.testing.assert_close(chunked.detach(), plain.detach(), rtol=0, atol=0)
    assert opt_chunked.param_groups[0]["params"] == [chunked]  # the group is restored
    for key, value in opt_plain.state[plain].items():
        got = opt_chunked.state[chunked][key]
        assert torch.equal(got, value) if torch.is_tensor(value) else got == value, key


def test_step_chunk_size_is_clamped_between_64_and_256_mib() -> None:
    from deepspeed._core.optim.chunked_step import step_chunk_numel

    assert step_chunk_numel(torch.float32) == (64 << 20) // 4  # a master offloaded to the host: the minimum
    assert step_chunk_numel(torch.bfloat16) == (64 << 20) // 2  # in elements of the master dtype
    assert step_chunk_numel(torch.float32, 1_000_000) == (64 << 20) // 4  # a small master: the minimum
    assert step_chunk_numel(torch.float32, 10**11) == (256 << 20) // 4  # a huge one: the cap


def test_step_chunk_grows_with_the_master_up_to_the_cap() -> None:
    from deepspeed._core.optim.chunked_step import STEP_CHUNKS_PER_MASTER, step_chunk_numel

    # A 386M-element master (3B over 8 ranks): a sixteenth is under the minimum, which stays.
    assert step_chunk_numel(torch.float32, 386_000_000) == (64 << 20) // 4
    # 1.6B elements: a sixteenth is 400 MB, rounded down to 256 MiB (the cap).
    assert step_chunk_numel(torch.float32, 1_600_000_000) == (256 << 20) // 4
    # 800M elements: 200 MB -> 128 MiB (rounded down to a power of two); the master then steps in at most
    # 2 * STEP_CHUNKS_PER_MASTER chunks.
    chunk = step_chunk_numel(torch.float32, 800_000_000)
    assert chunk == (128 << 20) // 4
    assert -(-800_000_000 // chunk) <= 2 * STEP_CHUNKS_PER_MASTER
    # 3.09e9 elements (3B at one rank): capped, 47 chunks instead of the 185 of 64 MiB chunks.
    assert -(-3_090_000_000 // step_chunk_numel(torch.float32, 3_090_000_000)) == 47


@pytest.mark.parametrize("bucket", [400, 10**6, 5 * 10**8])
def test_reduce_bucket_size_sizes_only_the_reducer(bucket: int) -> None:
    """The step chunk follows the master (and the norm its own constant) whatever ``reduce_bucket_size`` is."""
    from deepspeed._core.optim.chunked_step import step_chunk_numel
    from deepspeed.runtime.config import DeepSpeedConfig
    from tests._harness import run_distributed

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "reduce_bucket_size": bucket}}
    plan = DeepSpeedConfig(config).plan
    chunk, master_numel, bucket_numel = run_distributed(_chunk_sizes, 1, plan, timeout=60)[0]
    assert bucket_numel == bucket  # the reducer's buckets follow the key
    assert chunk == step_chunk_numel(torch.float32, master_numel) == (64 << 20) // 4  # the step does not


def _chunk_sizes(plan: object) -> tuple[int, int, int]:
    from deepspeed._core.optim.stage12 import ZeroOptimizer

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), plan, None, None)
    master_numel = max(g.master.param.numel() for g in opt.groups)
    return opt._step_chunk_numel, master_numel, opt.reducer.config.bucket_numel


class _Recorder(torch.optim.SGD):
    """SGD that remembers where each step's gradient lived."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=0.1)
        self.grad_ptrs: list[int] = []

    def step(self, closure=None):
        self.grad_ptrs += [p.grad.data_ptr() for g in self.param_groups for p in g["params"]]
        return super().step(closure)


def test_conversion_reuses_one_buffer_and_consumed_chunks_are_used_in_place() -> None:
    """A narrow gradient is converted through one buffer for every chunk (no fresh host tensor per chunk); a
    consumed gradient already in the master's dtype is stepped in place and released chunk by chunk."""
    from deepspeed._core.grads.accumulator import ChunkedGradShard

    master = torch.nn.Parameter(torch.zeros(100))
    opt = _Recorder([master])
    step_in_chunks(opt, 0, torch.ones(100, dtype=torch.bfloat16), 30, coef=0.5)
    assert len(opt.grad_ptrs) == 4 and len(set(opt.grad_ptrs)) == 1
    assert torch.equal(master.detach(), torch.full((100,), -0.05))

    shard = ChunkedGradShard(100, 30, torch.float32, "cpu")
    shard.add_(0, torch.ones(100))
    chunk_ptrs = [c.data_ptr() for c in shard.allocated()]
    opt.grad_ptrs.clear()
    step_in_chunks(opt, 0, shard, 30, coef=2.0, consume=True)
    assert opt.grad_ptrs == chunk_ptrs  # the chunks themselves, scaled in place
    assert shard.allocated_numel == 0  # each released once stepped
    assert torch.equal(master.detach(), torch.full((100,), -0.25))
