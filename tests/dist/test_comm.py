"""deepspeed.comm over gloo at world sizes 1, 2 and 4 (plus the fake backend and MPI-style env discovery).

Rank functions return what they observed; the assertions run in the pytest process against values computed
independently here, so a collective that silently does nothing fails the test.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

from deepspeed import comm as dist
from tests._harness import run_distributed

SIZES = [1, 2, 4]


# ---------------------------------------------------------------------- rank functions
def _identity() -> tuple:
    return (
        dist.get_rank(),
        dist.get_world_size(),
        dist.get_local_rank(),
        dist.is_initialized(),
        dist.get_backend(),
        dist.get_all_ranks_from_group(dist.get_world_group()),
    )


def _all_reduce_ops() -> dict:
    rank = dist.get_rank()
    out = {}
    for name, op in (
        ("sum", dist.ReduceOp.SUM),
        ("avg", dist.ReduceOp.AVG),
        ("max", dist.ReduceOp.MAX),
        ("torch_sum", torch.distributed.ReduceOp.SUM),
    ):
        t = torch.tensor([rank + 1.0, 10.0 * rank])
        dist.all_reduce(t, op=op)
        out[name] = t.tolist()
    return out


def _gather_scatter(force_fallback: bool) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    if force_fallback:
        from deepspeed.comm import comm as comm_module

        backend = comm_module.cdb.get_backend()
        for verb in ("reduce_scatter_tensor", "all_gather_into_tensor", "reduce_scatter", "all_to_all"):
            comm_module.cdb._native[(verb, backend)] = False
    gathered = torch.empty(3 * n)
    dist.all_gather_into_tensor(gathered, torch.full((3,), float(rank)))
    full = torch.arange(2.0 * n) + 100 * rank  # each rank contributes a different vector
    rs_sum, rs_avg = torch.empty(2), torch.empty(2)
    dist.reduce_scatter_tensor(rs_sum, full, op=dist.ReduceOp.SUM)
    dist.reduce_scatter_tensor(rs_avg, full.clone(), op=dist.ReduceOp.AVG)
    rs_list = torch.empty(2)
    dist.reduce_scatter(rs_list, list(full.chunk(n)))
    a2a_out = [torch.empty(1) for _ in range(n)]
    dist.all_to_all(a2a_out, [torch.tensor([10.0 * rank + dst]) for dst in range(n)])
    return {
        "gathered": gathered.tolist(),
        "rs_sum": rs_sum.tolist(),
        "rs_avg": rs_avg.tolist(),
        "rs_list": rs_list.tolist(),
        "a2a": [t.item() for t in a2a_out],
        "input_after": full.tolist(),
    }


def _broadcast_barrier_async() -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    b = torch.tensor([float(rank)] * 3)
    dist.broadcast(b, src=n - 1)
    dist.barrier()
    t = torch.tensor([float(rank)])
    handle = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
    handle.wait()
    rs = torch.empty(1)
    dist.reduce_scatter_tensor(rs, torch.ones(n) * (rank + 1), op=dist.ReduceOp.AVG, async_op=True).wait()
    ag = torch.empty(n)
    dist.all_gather_into_tensor(ag, torch.tensor([rank * 2.0]), async_op=True).wait()
    coalesced = [torch.tensor([1.0 * rank]), torch.tensor([2, 3]) * (rank + 1)]
    dist.all_reduce_coalesced(coalesced, async_op=True).wait()
    objects = [None] * n
    dist.all_gather_object(objects, {"rank": rank})
    return {
        "bcast": b.tolist(),
        "async_avg": t.item(),
        "rs_avg": rs.item(),
        "ag": ag.tolist(),
        "coalesced": [c.tolist() for c in coalesced],
        "objects": objects,
    }


def _subgroups() -> dict:
    rank = dist.get_rank()
    low, high = dist.new_group([0, 1]), dist.new_group([2, 3])
    mine = low if rank < 2 else high
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    return {
        "sum": t.item(),
        "group_rank": dist.get_rank(mine),
        "group_size": dist.get_world_size(mine),
        "global_of_0": dist.get_global_rank(mine, 0),
        "members": dist.get_all_ranks_from_group(mine),
        "other_rank": dist.get_rank(high if rank < 2 else low),
    }


def _init_from_ompi(port: str) -> tuple:
    # Replace the torchrun-style variables with what mpirun exports, then let init_distributed derive them.
    rank, size = os.environ.pop("RANK"), os.environ.pop("WORLD_SIZE")
    local_rank = os.environ.pop("LOCAL_RANK")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name)
    os.environ.update(
        OMPI_COMM_WORLD_RANK=rank,
        OMPI_COMM_WORLD_SIZE=size,
        OMPI_COMM_WORLD_LOCAL_RANK=local_rank,
        OMPI_COMM_WORLD_LOCAL_SIZE=size,
    )
    dist.init_distributed(dist_backend="gloo", distributed_port=port, verbose=False)
    t = torch.ones(1)
    dist.all_reduce(t)
    result = (
        dist.get_rank(),
        dist.get_world_size(),
        dist.get_local_rank(),
        os.environ["MASTER_ADDR"],
        os.environ["MASTER_PORT"],
        t.item(),
    )
    dist.barrier()  # rank 0 hosts the store: keep it alive until every rank is done
    dist.destroy_process_group()
    return result


def _fake_world() -> tuple:
    dist.init_distributed(dist_backend="fake", rank=5, world_size=64, verbose=False)
    sub = dist.new_group(list(range(8)))
    t = torch.ones(4)
    dist.all_reduce(t)
    out = torch.empty(64 * 4)
    dist.all_gather_into_tensor(out, t)
    result = (dist.get_rank(), dist.get_world_size(), dist.get_backend(), dist.get_world_size(sub), dist.get_rank(sub))
    dist.destroy_process_group()
    return result + (dist.is_initialized(),)


def _groups_and_logger() -> dict:
    from deepspeed.utils import groups

    dist.configure(enabled=True, prof_all=True)
    t = torch.ones(8)
    dist.all_reduce(t)
    stats = dist.log_summary(return_dict=True)
    dist.configure(enabled=False)
    try:
        groups._get_sequence_parallel_group()
        sp_group = "no error"
    except KeyError:
        sp_group = "KeyError"
    return {
        "dp_size": groups._get_data_parallel_world_size(),
        "dp_rank": groups._get_data_parallel_rank(),
        "sp_size": groups._get_sequence_parallel_world_size(),
        "sp_rank": groups._get_sequence_parallel_rank(),
        "sp_group": sp_group,
        "mp_size": groups._get_model_parallel_world_size(),
        "logged": sorted(stats["summary"]),
        "count": dist.get_comm_operation_count(),
    }


# ---------------------------------------------------------------------- tests
@pytest.mark.parametrize("n", SIZES)
def test_identity(n: int) -> None:
    results = run_distributed(_identity, n)
    assert results == [(r, n, r, True, "gloo", list(range(n))) for r in range(n)]


@pytest.mark.parametrize("n", SIZES)
def test_all_reduce_ops(n: int) -> None:
    expected_sum = [sum(r + 1.0 for r in range(n)), sum(10.0 * r for r in range(n))]
    expected = {
        "sum": expected_sum,
        "avg": [v / n for v in expected_sum],
        "max": [float(n), 10.0 * (n - 1)],
        "torch_sum": expected_sum,
    }
    assert run_distributed(_all_reduce_ops, n) == [expected] * n


def _expected_gather_scatter(n: int) -> list[dict]:
    inputs = [torch.arange(2.0 * n) + 100 * r for r in range(n)]
    total = sum(inputs)
    out = []
    for r in range(n):
        mine = total[2 * r : 2 * r + 2]
        out.append(
            {
                "gathered": [float(i) for i in range(n) for _ in range(3)],
                "rs_sum": mine.tolist(),
                "rs_avg": (mine / n).tolist(),
                "rs_list": mine.tolist(),
                "a2a": [10.0 * src + r for src in range(n)],
                "input_after": inputs[r].tolist(),
            }
        )
    return out


@pytest.mark.parametrize("n", SIZES)
def test_gather_scatter_native(n: int) -> None:
    assert run_distributed(_gather_scatter, n, False) == _expected_gather_scatter(n)


@pytest.mark.parametrize("n", [2, 4])
def test_gather_scatter_fallback(n: int) -> None:
    assert run_distributed(_gather_scatter, n, True) == _expected_gather_scatter(n)


@pytest.mark.parametrize("n", SIZES)
def test_broadcast_barrier_async(n: int) -> None:
    mean_rank = sum(range(n)) / n
    expected = {
        "bcast": [float(n - 1)] * 3,
        "async_avg": mean_rank,
        "rs_avg": (n + 1) / 2,
        "ag": [2.0 * r for r in range(n)],
        "coalesced": [[float(sum(range(n)))], [2 * n * (n + 1) // 2, 3 * n * (n + 1) // 2]],
        "objects": [{"rank": r} for r in range(n)],
    }
    assert run_distributed(_broadcast_barrier_async, n) == [expected] * n


def test_new_group_subgroups() -> None:
    results = run_distributed(_subgroups, 4)
    for rank, res in enumerate(results):
        base = 0 if rank < 2 else 2
        assert res == {
            "sum": float(2 * base + 1),
            "group_rank": rank - base,
            "group_size": 2,
            "global_of_0": base,
            "members": [base, base + 1],
            "other_rank": -1,
        }


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


@pytest.mark.parametrize("n", [1, 2])
def test_init_from_ompi_env(n: int) -> None:
    port = _free_port()
    results = run_distributed(_init_from_ompi, n, port, init_distributed=False)
    assert results == [(r, n, r, "127.0.0.1", port, float(n)) for r in range(n)]


def test_fake_backend_simulates_large_world() -> None:
    assert run_distributed(_fake_world, 1, init_distributed=False) == [(5, 64, "fake", 8, 5, False)]


def test_groups_defaults_and_comms_logger() -> None:
    results = run_distributed(_groups_and_logger, 2)
    for rank, res in enumerate(results):
        assert res["dp_size"] == 2 and res["dp_rank"] == rank
        assert (res["sp_size"], res["sp_rank"], res["sp_group"], res["mp_size"]) == (1, 0, "KeyError", 1)
        assert "all_reduce" in res["logged"] and res["count"] >= 1


def test_uninitialized_queries_assert() -> None:
    if dist.is_initialized():
        pytest.skip("a process group exists in the pytest process")
    with pytest.raises(AssertionError, match="init"):
        dist.get_rank()
    with pytest.raises(AssertionError):
        dist.get_world_size()


def test_reduce_op_conversion() -> None:
    from deepspeed.comm.backend import to_torch_op

    assert to_torch_op(dist.ReduceOp.MAX) == torch.distributed.ReduceOp.MAX
    assert to_torch_op(torch.distributed.ReduceOp.MIN) == torch.distributed.ReduceOp.MIN
    assert [op.name for op in dist.ReduceOp] == ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "UNUSED"]
    with pytest.raises(ValueError, match="UNUSED"):
        to_torch_op(dist.ReduceOp.UNUSED)


_ADOPTED_GROUP = """
import os, socket, sys
import torch.distributed as td
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
td.init_process_group("gloo", rank=0, world_size=1)  # created by another library first (HF's accelerate does)
import deepspeed
from deepspeed.comm import backend
deepspeed.init_distributed(dist_backend="gloo")
assert backend._teardown_registered, "an adopted group must be torn down at exit too"
print("ADOPTED_OK", flush=True)
"""


def test_group_created_by_another_library_is_torn_down_at_exit() -> None:
    """A gloo group alive at interpreter exit can abort a finished run (exit 134); DeepSpeed registers its
    teardown also when it adopts a group someone else created, and the process exits cleanly."""
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, "-c", _ADOPTED_GROUP], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ADOPTED_OK" in proc.stdout, proc.stdout + proc.stderr
    assert "destroy_process_group" not in proc.stderr  # no warning about a group left alive
