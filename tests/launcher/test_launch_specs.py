"""Per-node launcher and MPI helper: rank numbering, environments and argv (pure functions)."""

from __future__ import annotations

import sys
from collections import OrderedDict

import pytest

from deepspeed.launcher.launch import build_rank_specs, node_layout, parse_args
from deepspeed.launcher.launcher_helper import parse_args as helper_args
from deepspeed.launcher.launcher_helper import program_argv, rank_env
from deepspeed.launcher.numa import cores_for_rank, format_core_list, numactl_prefix, parse_core_list

WORLD = OrderedDict([("a", [0, 1]), ("b", [2, 5, 7])])


def test_node_layout_numbers_ranks_host_by_host() -> None:
    layout = node_layout(WORLD, 1)
    assert (layout.first_rank, layout.world_size, layout.slots, layout.num_nodes) == (2, 5, (2, 5, 7), 2)
    with pytest.raises(ValueError, match="--node_rank 2 out of range"):
        node_layout(WORLD, 2)


def _specs(*flags: str, has_gpus: bool = True, cores: list[int] | None = None, environ: dict | None = None) -> list:
    args = parse_args(
        ["--node_rank=1", "--master_addr=10.0.0.1", "--master_port=6000", *flags, "train.py", "--x", "y z"]
    )
    return build_rank_specs(args, environ or {"KEEP": "1"}, node_layout(WORLD, 1), has_gpus, cores, "20250101000000")


def test_rank_env_on_gpu_node() -> None:
    specs = _specs()
    assert [(s.global_rank, s.local_rank) for s in specs] == [(2, 0), (3, 1), (4, 2)]
    env = specs[2].env
    expected = {"RANK": "4", "LOCAL_RANK": "2", "WORLD_SIZE": "5", "LOCAL_SIZE": "3", "LOCAL_WORLD_SIZE": "3",
                "CROSS_RANK": "1", "CROSS_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "6000",
                "CUDA_VISIBLE_DEVICES": "2,5,7", "KEEP": "1"}  # fmt: skip
    assert {k: env[k] for k in expected} == expected and "DS_ACCELERATOR" not in env
    assert list(specs[1].argv) == [sys.executable, "-u", "train.py", "--local_rank=1", "--x", "y z"]


def test_cpu_node_sets_ds_accelerator_but_not_visible_devices() -> None:
    env = _specs(has_gpus=False)[0].env
    assert env["DS_ACCELERATOR"] == "cpu" and "CUDA_VISIBLE_DEVICES" not in env
    assert _specs(has_gpus=False, environ={"DS_ACCELERATOR": "mps"})[0].env["DS_ACCELERATOR"] == "mps"


def test_argv_variants() -> None:
    assert list(_specs("--no_local_rank")[0].argv) == [sys.executable, "-u", "train.py", "--x", "y z"]
    assert list(_specs("--module")[0].argv[:4]) == [sys.executable, "-u", "-m", "train.py"]
    assert list(_specs("--no_python")[0].argv) == ["train.py", "--local_rank=0", "--x", "y z"]


def test_log_paths_and_core_binding() -> None:
    specs = _specs("--enable_each_rank_log=/logs", cores=[0, 1, 2, 3, 4, 5, 6])
    assert specs[1].log_path == "/logs/20250101000000_rank3.log"
    assert [list(s.argv[:3]) for s in specs] == [
        ["numactl", "-C", "0-2"],
        ["numactl", "-C", "3-4"],
        ["numactl", "-C", "5-6"],
    ]
    assert [s.env["OMP_NUM_THREADS"] for s in specs] == ["3", "2", "2"]


def test_core_list_helpers() -> None:
    assert parse_core_list("0-3, 8,10-11,2") == [0, 1, 2, 3, 8, 10, 11]
    with pytest.raises(ValueError, match="malformed entry"):
        parse_core_list("0-")
    assert format_core_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert numactl_prefix([4]) == ["numactl", "-C", "4"]
    with pytest.raises(ValueError, match="need at least one core per rank"):
        cores_for_rank([0], 2, 0)


@pytest.mark.parametrize(
    ("tool_env", "expected"),
    [
        ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, ("5", "8", "1", "4")),
        ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, ("3", "4", "1", "2")),
        ({"SLURM_PROCID": "7", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3", "SLURM_NTASKS_PER_NODE": "4(x2)"},
         ("7", "8", "3", "4")),
    ],
)  # fmt: skip
def test_helper_maps_tool_rank_variables(tool_env: dict, expected: tuple) -> None:
    env = rank_env({"RANK": "stale", **tool_env})
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_SIZE"]) == expected
    assert env["LOCAL_WORLD_SIZE"] == expected[3]


def test_helper_program_argv() -> None:
    assert program_argv(helper_args(["--module", "pkg.mod", "--a", "1"]), "py") == [
        "py",
        "-u",
        "-m",
        "pkg.mod",
        "--a",
        "1",
    ]
    assert program_argv(helper_args(["--no_python", "prog", "x"]), "py") == ["prog", "x"]
