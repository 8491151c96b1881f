"""Shards cut from one buffer per dtype and device ([Note: shard arena] in ``deepspeed/_core/params/placement.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepspeed._core.comm.groups import ShardGroup
from deepspeed._core.config.plan import LeanPolicy, Stage3Policy
from deepspeed._core.layout.flat_buffer import free_storage
from deepspeed._core.params.gather import ParamTarget
from deepspeed._core.params.manager import ParamStorage, ShardAllocation, ZeroParamManager
from deepspeed._core.params.placement import SHARD_ALIGN_BYTES, arena_shards

WORLD1 = ShardGroup(None, 0, 1)
CPU = torch.device("cpu")


def test_arena_layout_aligns_each_shard_and_groups_by_dtype() -> None:
    requests = [(5, torch.float32, CPU), (3, torch.bfloat16, CPU), (70, torch.float32, CPU), (0, torch.float32, CPU)]
    shards = arena_shards(requests)
    assert [(s.numel(), s.dtype) for s in shards] == [(n, d) for n, d, _ in requests]
    fp32 = [s for s in shards if s.dtype == torch.float32]
    assert len({s.untyped_storage().data_ptr() for s in fp32}) == 1
    assert shards[1].untyped_storage().data_ptr() != fp32[0].untyped_storage().data_ptr()
    for s in shards:
        assert s.numel() == 0 or (s.storage_offset() * s.element_size()) % SHARD_ALIGN_BYTES == 0
        assert torch.count_nonzero(s) == 0
    shards[0].fill_(1.0)
    assert torch.count_nonzero(shards[2]) == 0, "shards must not overlap"
    # 5 elements rounded up to 64 (256 bytes of fp32), then 70: the buffer is exactly that large.
    assert fp32[0].untyped_storage().nbytes() == (64 + 70) * 4


def test_free_storage_refuses_a_view_of_a_larger_buffer() -> None:
    first, _ = arena_shards([(4, torch.float32, CPU), (4, torch.float32, CPU)])
    with pytest.raises(ValueError, match="whole storage"):
        free_storage(first)  # offset 0, contiguous: only the size tells it apart from a buffer of its own
    assert first.untyped_storage().nbytes() > 0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 9)
        self.norm = nn.LayerNorm(9)
        self.b = nn.Linear(9, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.norm(self.a(x)))).square().mean()


def _grads_and_loss(arena: bool, own: bool = False) -> tuple[int, float, dict[str, torch.Tensor]]:
    """``own``: parameters keep their storage as their shards ([Note: own storage as shard]); else they are
    copied into an arena or one allocation each."""
    torch.manual_seed(0)
    model = Net()
    names = {id(p): n for n, p in model.named_parameters()}
    before = {n: p.data.data_ptr() for n, p in model.named_parameters()}
    manager = ZeroParamManager(
        model,
        WORLD1,
        Stage3Policy(param_persistence_threshold=10),  # the norm's parameters stay gathered
        LeanPolicy(inplace_flatten=own),
        target=ParamTarget(CPU, torch.float32),
        storage=ParamStorage(shards=ShardAllocation.ARENA if arena else ShardAllocation.PER_PARAMETER),
    )
    grads: dict[str, torch.Tensor] = {}

    def take(param: nn.Parameter, state: object, grad: torch.Tensor) -> None:
        grads[names[id(param)]] = grad.clone()

    manager.on_grad_ready(take)
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))
    loss = model(x)
    loss.backward()
    storages = len({s.shard.untyped_storage().data_ptr() for s in manager.states.values()})
    kept = sum(before[names[id(s.param)]] == s.shard.data_ptr() for s in manager.states.values())
    manager.destroy()
    return (storages, kept), float(loss.detach()), grads


def test_manager_with_an_arena_computes_the_same() -> None:
    storages, loss, grads = _grads_and_loss(arena=True)
    ref_storages, ref_loss, ref_grads = _grads_and_loss(arena=False)
    own_storages, own_loss, own_grads = _grads_and_loss(arena=True, own=True)
    assert storages == (1, 0) and ref_storages == (6, 0) and len(ref_grads) == 6
    assert own_storages == (6, 6)  # every shard is its parameter's own storage: nothing was allocated
    for got, got_loss in ((grads, loss), (own_grads, own_loss)):
        assert got_loss == ref_loss and got.keys() == ref_grads.keys()
        for name, grad in ref_grads.items():
            assert torch.equal(got[name], grad), name


def test_only_a_parameter_alone_in_its_storage_keeps_it_as_its_shard() -> None:
    # [Note: own storage as shard]: a view of a larger buffer, two parameters on one storage and a parameter in
    # another dtype than the working one are copied; the others keep their storage.
    model = Net()
    base = torch.randn(200)
    model.a.weight = nn.Parameter(base[:63].view(9, 7))  # a view of a larger buffer
    model.b.bias = nn.Parameter(model.norm.bias.data)  # one storage behind two parameters
    model.norm.weight = nn.Parameter(model.norm.weight.data.double())  # cast to the working dtype on the way
    before = {id(p): p.data.data_ptr() for p in model.parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    manager = ZeroParamManager(
        model,
        WORLD1,
        Stage3Policy(),
        LeanPolicy(),
        target=ParamTarget(CPU, torch.float32),
        storage=ParamStorage(shards=ShardAllocation.ARENA),
    )
    kept = sorted(names[id(s.param)] for s in manager.states.values() if before[id(s.param)] == s.shard.data_ptr())
    assert kept == ["a.bias", "b.weight"]
    assert all(s.shard.dtype == torch.float32 for s in manager.states.values())
    manager.destroy()


def test_arena_segments_are_cut_once_the_parameters_before_them_are_partitioned(monkeypatch) -> None:
    # [Note: shard arena]: a segment is allocated when its first parameter comes up, after the parameters before it
    # freed their full storage, so a model built where its shards go never holds all its shards beside itself.
    import deepspeed._core.params.manager as manager_module
    import deepspeed._core.params.placement as placement
    from deepspeed._core.params.param import zero_state

    monkeypatch.setattr(placement, "ARENA_SEGMENT_BYTES", 64 * 4)  # 64 fp32 elements of shards at least
    model = Net()
    order = list(model.parameters())  # a.weight 63, a.bias 9 | norm 9 + 9, b.weight 27, b.bias 3
    partitioned_at_cut = []
    real = manager_module.arena_shards

    def spy(requests):
        partitioned_at_cut.append([zero_state(p) is not None for p in order])
        return real(requests)

    monkeypatch.setattr(manager_module, "arena_shards", spy)
    manager = ZeroParamManager(
        model,
        WORLD1,
        Stage3Policy(),
        LeanPolicy(inplace_flatten=False),  # every parameter is copied into the arena
        target=ParamTarget(CPU, torch.float32),
        storage=ParamStorage(shards=ShardAllocation.ARENA),
    )
    assert partitioned_at_cut == [[False] * 6, [True, True] + [False] * 4]
    assert len({s.shard.untyped_storage().data_ptr() for s in manager.states.values()}) == 2
    manager.destroy()
