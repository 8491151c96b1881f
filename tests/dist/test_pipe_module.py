"""PipelineModule over real process groups (gloo): what each stage builds, tied weights, grid, checkpointed forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests._harness import run_distributed

BUILT: list[str] = []  # per process: class names of layers built on a real (non-meta) device


class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim) * 0.1)
        if self.weight.device.type != "meta":
            BUILT.append(type(self).__name__)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        if self.fc.weight.device.type != "meta":
            BUILT.append(type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def _head(embed: Embed, x: torch.Tensor) -> torch.Tensor:
    return x @ embed.weight.t()


def _layers(blocks: int = 4, tied: bool = False) -> list:
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    first = TiedLayerSpec("embed", Embed, 11, 8) if tied else LayerSpec(Embed, 11, 8)
    layers = [first] + [LayerSpec(Block, 8) for _ in range(blocks)]
    if tied:
        layers.append(TiedLayerSpec("embed", Embed, 11, 8, forward_fn=_head))
    return layers


def _reference(blocks: int, tied: bool, base_seed: int = 1234) -> list:
    """The whole model built in one process, layer i seeded with base_seed + i (what seed_layers promises)."""
    layers = []
    for idx, spec in enumerate(_layers(blocks, tied)):
        torch.manual_seed(base_seed + idx)
        if tied and idx == len(_layers(blocks, tied)) - 1:
            layers.append(lambda x, emb=layers[0]: _head(emb, x))
        else:
            layers.append(spec.build())
    return layers


def _build_and_report(method: str, tied: bool) -> dict:
    from deepspeed.pipe import PipelineModule

    BUILT.clear()
    module = PipelineModule(_layers(4, tied), num_stages=2, partition_method=method, seed_layers=True)
    return {
        "parts": module.parts,
        "stage": module.stage_id,
        "built": list(BUILT),
        "range": module.stage_layer_range(),
        "names": sorted(n for n, _ in module.named_parameters()),
    }


@pytest.mark.parametrize(
    "method, parts",
    [("uniform", [0, 3, 5]), ("parameters", [0, 2, 5]), ("type:block", [0, 3, 5]), ("type:embed", None)],
)
def test_each_stage_builds_only_its_layers(method: str, parts: list | None) -> None:
    if parts is None:  # one Embed layer cannot be balanced over two stages: a clear error on both ranks
        msgs = run_distributed(_build_error, 2, method, timeout=60)
        assert all("partition_method 'type:embed' matches 1 layers" in m for m in msgs), msgs
        return
    reports = run_distributed(_build_and_report, 2, method, False, timeout=60)
    for rank, rep in enumerate(reports):
        assert rep["parts"] == parts and rep["stage"] == rank
        start, stop = rep["range"]
        expected = ["Embed" if i == 0 else "Block" for i in range(start, stop)]
        assert rep["built"] == expected, f"rank {rank} built {rep['built']}"
        names = [f"{i}.weight" if i == 0 else f"{i}.fc.{w}" for i in range(start, stop) for w in ("bias", "weight")]
        assert rep["names"] == sorted(set(names))


def _build_error(method: str) -> str:
    from deepspeed.pipe import PipelineModule

    try:
        PipelineModule(_layers(4), num_stages=2, partition_method=method)
    except ValueError as err:
        return str(err)
    return "no error"


def _bad_modules(cases: list[str]) -> dict[str, str]:
    return {case: _bad_module(case) for case in cases}


def _bad_module(case: str) -> str:
    from deepspeed.pipe import PipelineModule, ProcessTopology
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    kwargs = {
        "num_stages_3": dict(layers=_layers(4), num_stages=3),
        "too_few_layers": dict(layers=_layers(0), num_stages=2),
        "topology_world": dict(layers=_layers(4), topology=PipeDataParallelTopology(2, 2)),
        "topology_mismatch": dict(layers=_layers(4), num_stages=1, topology=PipeDataParallelTopology(2, 1)),
        "no_pipe_axis": dict(layers=_layers(4), topology=ProcessTopology(["data"], [2])),
        "unknown_method": dict(layers=_layers(4), num_stages=2, partition_method="best"),
        "neither": dict(layers=_layers(4)),
        "bad_layer": dict(layers=[*_layers(2), 3], num_stages=2),
        "interval": dict(layers=_layers(4), num_stages=2, activation_checkpoint_interval=-1),
    }[case]
    try:
        PipelineModule(**kwargs)
    except (ValueError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


BAD = {
    "num_stages_3": "num_stages=3 does not divide the world size 2",
    "too_few_layers": "1 layers cannot fill 2 pipeline stages",
    "topology_world": "topology has 4 ranks",
    "topology_mismatch": "num_stages=1 disagrees",
    "no_pipe_axis": "must have a 'pipe' axis",
    "unknown_method": "partition_method 'best' is not supported",
    "neither": "give num_stages or topology",
    "bad_layer": "layers[3] is int",
    "interval": "activation_checkpoint_interval",
}


def test_bad_module_fails_on_every_rank() -> None:
    """Each case raises on both ranks before the grid's first collective (a hang would time the call out)."""
    per_rank = run_distributed(_bad_modules, 2, sorted(BAD), timeout=60)
    for case, needle in BAD.items():
        assert all(needle in rep[case] for rep in per_rank), (case, [rep[case] for rep in per_rank])


def _tied_grid_checks() -> dict:
    from deepspeed import comm as dist
    from deepspeed.pipe import PipelineModule

    module = PipelineModule(_layers(2, tied=True), num_stages=2, partition_method="uniform", seed_layers=True)
    grid = module.mpu()
    ((weight, group),) = module.get_tied_weights_and_groups()
    gathered = [torch.zeros_like(weight) for _ in range(2)]
    dist.all_gather(gathered, weight.detach().clone(), group=group)
    weight.grad = torch.full_like(weight, float(dist.get_rank() + 1))
    module.allreduce_tied_weight_gradients()
    seeds: list[int] = []
    seeded = PipelineModule(
        _layers(2, tied=True),
        num_stages=2,
        partition_method="uniform",
        seed_layers=True,
        seed_fn=seeds.append,
        base_seed=100,
    )
    return {
        "seeds": seeds,
        "seeded_range": seeded.stage_layer_range(),
        "equal": bool(torch.equal(gathered[0], gathered[1])),
        "grad": float(weight.grad[0, 0]),
        "weight": weight.detach().clone(),
        "stage": grid.get_stage_id(),
        "dp": grid.dp_group,
        "pp": grid.pp_group,
        "first": grid.is_first_stage,
        "last": grid.is_last_stage,
        "keys": sorted(module.state_dict()),
    }


def test_tied_weights_synchronised_and_grads_summed() -> None:
    a, b = run_distributed(_tied_grid_checks, 2, timeout=60)
    assert a["equal"] and b["equal"]
    for rep in (a, b):  # seed_fn(base_seed + global index) before each layer this stage builds
        start, stop = rep["seeded_range"]
        assert rep["seeds"] == [100 + i for i in range(start, stop)], rep["seeds"]
    ref = _reference(2, tied=True)
    assert torch.equal(a["weight"], ref[0].weight)  # the first holder's (seeded) copy wins
    assert a["grad"] == b["grad"] == 3.0
    assert (a["stage"], a["first"], a["last"], a["pp"], a["dp"]) == (0, True, False, [0, 1], [0])
    assert (b["stage"], b["first"], b["last"]) == (1, False, True)
    assert a["keys"] == ["1.fc.bias", "1.fc.weight", "tied_modules.embed.weight"]
    assert b["keys"] == ["2.fc.bias", "2.fc.weight", "tied_modules.embed.weight"]


def _grid_4() -> dict:
    from deepspeed import comm as dist
    from deepspeed.pipe import PipelineModule

    module = PipelineModule(_layers(4), num_stages=2, partition_method="uniform")
    grid = module.mpu()
    probe = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(probe, group=grid.get_data_parallel_group())
    return {
        "stage": grid.get_stage_id(),
        "dp_rank": grid.get_data_parallel_rank(),
        "dp_size": grid.get_data_parallel_world_size(),
        "pp_size": grid.get_pipe_parallel_world_size(),
        "mp_rank": grid.get_model_parallel_rank(),
        "mp_size": grid.get_model_parallel_world_size(),
        "slice": (grid.get_slice_parallel_rank(), grid.get_slice_parallel_world_size()),
        "tp_size": grid.get_tensor_model_parallel_world_size(),
        "dp_sum": float(probe),
        "next": grid.stage_to_global(grid.next_stage) if not grid.is_last_stage else None,
        "prev": grid.stage_to_global(grid.prev_stage) if not grid.is_first_stage else None,
    }


def test_grid_pipe_by_data_parallel() -> None:
    reports = run_distributed(_grid_4, 4, timeout=90)
    # Ranks 0,1 are stage 0 (replicas 0,1); ranks 2,3 are stage 1.
    assert [r["stage"] for r in reports] == [0, 0, 1, 1]
    assert [r["dp_rank"] for r in reports] == [0, 1, 0, 1]
    assert [r["dp_sum"] for r in reports] == [1.0, 1.0, 5.0, 5.0]
    assert [r["mp_rank"] for r in reports] == [0, 0, 1, 1]
    assert all(r["dp_size"] == 2 and r["pp_size"] == 2 and r["mp_size"] == 2 for r in reports)
    assert all(r["slice"] == (0, 1) and r["tp_size"] == 1 for r in reports)
    assert [r["next"] for r in reports] == [2, 3, None, None]
    assert [r["prev"] for r in reports] == [None, None, 0, 1]


def _stage_grads_all(intervals: list[int], tied: bool) -> dict:
    return {i: _stage_grads(i, tied) for i in intervals}


def _stage_grads(interval: int, tied: bool) -> dict:
    """Single-stage pipeline module vs the seeded reference: same loss and gradients, with or without checkpoints."""
    from deepspeed.pipe import PipelineModule

    module = PipelineModule(_layers(3, tied), num_stages=1, seed_layers=True, activation_checkpoint_interval=interval)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    out = module(ids)
    loss = out.square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    return {"loss": loss.item(), "grads": grads}


@pytest.mark.parametrize("tied", [False, True])
def test_forward_matches_reference_with_and_without_checkpointing(tied: bool) -> None:
    ref_layers = _reference(3, tied)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    x = ids
    for layer in ref_layers:
        x = layer(x)
    loss = x.square().mean()
    loss.backward()
    embed_grad = ref_layers[0].weight.grad
    (reports,) = run_distributed(_stage_grads_all, 1, [0, 1, 2], tied, timeout=60)
    for interval, rep in reports.items():
        assert abs(rep["loss"] - loss.item()) < 1e-6, interval
        key = "tied_modules.embed.weight" if tied else "0.weight"
        # The embedding's input (token ids) needs no grad: checkpointing must still give it its gradient.
        torch.testing.assert_close(rep["grads"][key], embed_grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rep["grads"]["1.fc.weight"], ref_layers[1].fc.weight.grad, rtol=1e-5, atol=1e-6)
