"""ZeRO-3 parameter side over gloo at world sizes 1, 2 and 4 (several checks per spawn to save start-up cost).

Checks: loss and full gradients equal an unsharded reference (tied embedding, a module called twice, an
activation-checkpointed module, frozen parameters, an external parameter); gathered units alive at each module
boundary bounded by the prefetch window; nothing gathered after backward or an eval; ``GatheredParameters`` with
and without a modifier rank; ``zero.Init`` partitioning at construction, its dtype rule and nesting counter.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from deepspeed import comm as dist
from deepspeed._core.config.plan import LeanPolicy, Stage3Policy
from deepspeed._core.params.manager import ZeroParamManager
from deepspeed._core.comm.groups import ShardGroup
from deepspeed._core.params.param import ZeroParamStatus
from deepspeed.runtime.zero import GatheredParameters, Init, register_external_parameter
from deepspeed.runtime.zero.partition_parameters import zero_init_depth
from tests._harness import run_distributed

VOCAB, DIM = 13, 8


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Holder(nn.Module):
    """Owns a parameter but is never called."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, dim))


class Mixer(nn.Module):
    """Uses ``holder.scale`` without owning it (external parameter)."""

    def __init__(self, holder: Holder) -> None:
        super().__init__()
        self.__dict__["holder"] = holder  # a plain reference, not a submodule
        register_external_parameter(self, holder.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.holder.scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(2))
        self.twice = Block(DIM)
        self.checkpointed = Block(DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.holder = Holder(DIM)
        self.mixer = Mixer(self.holder)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        h = self.twice(self.twice(h))
        h = checkpoint(self.checkpointed, h, use_reentrant=False)
        return self.head(self.mixer(self.frozen(h)))


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    return [
        (torch.randint(0, VOCAB, (3, 5), generator=gen), torch.randint(0, VOCAB, (3, 5), generator=gen))
        for _ in range(world)
    ]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    ids, target = batch
    return F.cross_entropy(model(ids).reshape(-1, VOCAB), target.reshape(-1))


def _reference(world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Net()
    losses = [_loss(model, batch) for batch in _batches(world)]
    sum(losses).backward()
    return [loss.item() for loss in losses], {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _check_numerics(rank: int, world: int) -> dict:
    ref_losses, ref_grads = _reference(world)
    torch.manual_seed(0)
    model = Net()
    policy = Stage3Policy(prefetch_bucket_size=2 * (DIM * DIM + DIM), param_persistence_threshold=0)
    manager = ZeroParamManager(model, ShardGroup.resolve(), policy, LeanPolicy())
    assert model.holder.scale.is_external_param
    names = {p.ds_id: n for n, p in model.named_parameters()}
    grads: dict[str, torch.Tensor] = {}

    def take(param: nn.Parameter, state: object, grad: torch.Tensor) -> None:
        name = names[param.ds_id]  # a routed (tied) parameter arrives once per use: add them up
        grads[name] = grad.clone() if name not in grads else grads[name] + grad
        param.grad = None  # what the ZeRO-3 optimizer does once the gradient is in its bucket

    manager.on_grad_ready(take)
    batch = _batches(world)[rank]
    for step in range(3):  # step 0 records the trace, later steps replay it with prefetch
        grads.clear()
        loss = _loss(model, batch)
        loss.backward()
        assert manager.count_gathered().params_alive == 0, "gathered params survived backward"
        assert math.isclose(loss.item(), ref_losses[rank], rel_tol=1e-5), (step, loss.item(), ref_losses[rank])
        assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
        for name, grad in grads.items():
            dist.all_reduce(grad)
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=f"{name} step {step}")
        assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
    with torch.no_grad():
        model(batch[0])
    assert manager.count_gathered().params_alive == 0, "gathered params survived an eval forward"
    mode, invalidations = manager.trace.mode.name, manager.trace.invalidations
    manager.destroy()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    return {"trace": mode, "invalidations": invalidations}


def _check_counts(world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    policy = Stage3Policy(prefetch_bucket_size=16 * 16 + 16, param_persistence_threshold=0)
    manager = ZeroParamManager(model, ShardGroup.resolve(), policy, LeanPolicy())
    manager.boundary_samples = []
    for _ in range(3):
        model(torch.randn(4, 16)).square().mean().backward()
    samples = manager.boundary_samples
    excess = max(s.units_alive - s.units_active for s in samples)
    alive = max(s.units_alive for s in samples)
    assert excess <= 1 and alive <= 2, (excess, alive)
    manager.destroy()
    return {"max_units_alive": alive, "max_excess_over_active": excess, "boundaries": len(samples)}


class Probe(nn.Module):
    """Records how many full-size parameter elements exist after each child is built."""

    def __init__(self) -> None:
        super().__init__()
        self.visible: list[int] = []
        self.first = nn.Linear(10, 7)
        self.visible.append(sum(p.data.numel() for p in self.parameters()))
        self.second = nn.Linear(7, 5)
        self.visible.append(sum(p.data.numel() for p in self.parameters()))
        self.third = nn.Linear(5, 3)
        self.visible.append(sum(p.data.numel() for p in self.parameters()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.third(torch.relu(self.second(torch.relu(self.first(x)))))


def _check_init_and_gathered(rank: int, world: int) -> dict:
    original_init = nn.Linear.__init__
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    torch.manual_seed(rank)  # different seeds per rank: Init must broadcast rank 0's values
    with Init(config_dict_or_path=cfg):
        model = Probe()
    assert nn.Linear.__init__ is original_init, "Init did not restore nn.Linear.__init__"
    assert model.visible == [0, 0, 0], model.visible
    for param in model.parameters():
        assert param.ds_tensor.numel() == math.ceil(param.ds_numel / world) and param.ds_tensor.dtype == torch.float
    with GatheredParameters(list(model.parameters())):
        values = [p.detach().clone() for p in model.parameters()]
    for value in values:
        copies = [torch.empty_like(value) for _ in range(world)]
        dist.all_gather(copies, value)
        assert all(torch.equal(c, value) for c in copies), "ranks built different values"
    weight = model.first.weight
    with GatheredParameters([weight], modifier_rank=0):
        if rank == 0:
            weight.data.fill_(1.5)
    assert weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
    with GatheredParameters(weight):
        assert torch.all(weight == 1.5), "modifier rank's values did not reach every shard"
        weight.data.fill_(7.0)
    with GatheredParameters(weight):
        assert torch.all(weight == 1.5), "read-only gather leaked a modification"
    manager = ZeroParamManager(model, ShardGroup.resolve(), Stage3Policy(param_persistence_threshold=0), LeanPolicy())
    out = model(torch.ones(2, 10))
    with GatheredParameters(list(model.parameters())):
        reference = nn.Sequential(nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))
        with torch.no_grad():
            for dst, src in zip(reference.parameters(), model.parameters()):
                dst.copy_(src)
    torch.testing.assert_close(out, reference(torch.ones(2, 10)))
    manager.destroy()
    return {"shard_numel": [p.ds_tensor.numel() for p in model.parameters()]}


def _check_init_dtype_rule() -> dict:
    with Init():
        bare = nn.Linear(4, 4)
    with Init(dtype=torch.float), Init():
        depth = zero_init_depth()
        nested = nn.Linear(4, 4)
    assert zero_init_depth() == 0
    outer, overlapping = GatheredParameters(nested.weight), GatheredParameters([nested.weight, nested.bias])
    with pytest.raises(RuntimeError, match="already gathered"), outer, overlapping:
        pass
    assert nested.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
    return {
        "bare_dtype": str(bare.weight.ds_tensor.dtype),
        "nested_depth": depth,
        "nested_dtype": str(nested.weight.ds_tensor.dtype),
    }


def _all_checks() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {"numerics": _check_numerics(rank, world), "counts": _check_counts(world)}
    report["init"] = _check_init_and_gathered(rank, world)
    report["dtype"] = _check_init_dtype_rule()
    return report


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_zero3_parameter_side(world_size: int) -> None:
    reports = run_distributed(_all_checks, world_size, timeout=240)
    first = reports[0]
    assert first["numerics"] == {"trace": "COMPLETE", "invalidations": 0}
    assert first["counts"]["max_excess_over_active"] == 1
    assert first["dtype"] == {"bare_dtype": "torch.float16", "nested_depth": 2, "nested_dtype": "torch.float32"}
    assert first["init"]["shard_numel"] == [math.ceil(n / world_size) for n in (70, 7, 35, 5, 15, 3)]
