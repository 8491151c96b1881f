"""``init_distributed`` under each launch environment: SLURM task variables, MPI, torch's names, none, half of one.

The ``deepspeed`` launcher is covered here too. The detection itself (``deepspeed._foundation.launch_env``) is
checked on plain dictionaries; the end-to-end tests start two real processes with only a launcher's variables and
check they come up as ranks 0 and 1 of one world and train a step equal to the single-process reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from deepspeed._foundation import launch_env
from deepspeed._foundation.launch_env import LaunchEnvError, detect, expand_hostlist
from tests.launcher._launch import TRAIN_STEP, assert_trained_world, clean_env, free_port, python_step, run_all


@pytest.mark.parametrize(("spec", "hosts"), [
    ("node07", ["node07"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[8-10]-ib,b3", ["a8-ib", "a9-ib", "a10-ib", "b3"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("gpu[002,010]", ["gpu002", "gpu010"]),
])  # fmt: skip
def test_expand_hostlist(spec: str, hosts: list[str]) -> None:
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["node[01-", "node]1[", "node[4-2]", "node[a-b]"])
def test_expand_hostlist_rejects_malformed(spec: str) -> None:
    with pytest.raises(LaunchEnvError, match="malformed SLURM host list"):
        expand_hostlist(spec)


SRUN = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS_PER_NODE": "4(x2)",
    "SLURM_NODELIST": "gpu[17-18]",
    "SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3",
}


def test_slurm_task_layout_and_master_from_first_host() -> None:
    found = detect(SRUN)
    assert found.launcher is launch_env.SLURM
    assert (found.rank, found.world_size, found.local_rank, found.local_size) == (5, 8, 1, 4)
    assert found.master_addr == "gpu17"
    assert found.torch_env() == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_SIZE": "4",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu17",
    }


def test_slurm_master_fallbacks_and_step_count() -> None:
    no_list = {k: v for k, v in SRUN.items() if k != "SLURM_NODELIST"}
    assert detect(no_list).master_addr == "10.1.2.3"
    assert detect({**SRUN, "MASTER_ADDR": "head"}).master_addr == "head"
    # srun inside an allocation: the job step's task count is the world, not the job's.
    assert detect({**SRUN, "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "8"}).world_size == 8
    two_nodes = {k: v for k, v in no_list.items() if k != "SLURM_LAUNCH_NODE_IPADDR"}
    assert detect(two_nodes).master_addr is None


def test_allocation_shell_is_not_a_task() -> None:
    # sbatch/salloc shells carry SLURM_NTASKS but no task id: a plain `python train.py` there is one process.
    assert detect({"SLURM_NTASKS": "4", "SLURM_NODELIST": "n[1-2]"}) is None


def test_torch_names_win_over_slurm_and_tools_win_in_the_shim() -> None:
    torchrun = {**SRUN, "RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2"}
    assert detect(torchrun).launcher is launch_env.TORCH and detect(torchrun).rank == 2
    assert detect(torchrun, tool_first=True).launcher is launch_env.SLURM


def test_open_mpi_layout() -> None:
    found = detect(
        {
            "OMPI_COMM_WORLD_RANK": "1",
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        }
    )
    assert (found.launcher, found.rank, found.world_size, found.master_addr) == (launch_env.OPEN_MPI, 1, 2, "127.0.0.1")
    multi = detect({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert multi.master_addr is None


@pytest.mark.parametrize(("environ", "missing"), [
    ({"RANK": "1"}, "WORLD_SIZE missing"),
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK missing"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE missing"),
    ({"PMI_SIZE": "2"}, "PMI_RANK missing"),
    ({"SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, "SLURM_STEP_NUM_TASKS or SLURM_NTASKS missing"),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, "SLURM_LOCALID missing"),
])  # fmt: skip
def test_half_specified_environment_names_what_is_missing(environ: dict, missing: str) -> None:
    with pytest.raises(LaunchEnvError, match=missing):
        detect(environ)


def test_bad_values_are_named() -> None:
    with pytest.raises(LaunchEnvError, match="SLURM_PROCID=3 is not a valid rank for SLURM_NTASKS=2"):
        detect({"SLURM_PROCID": "3", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"})
    with pytest.raises(LaunchEnvError, match="WORLD_SIZE='two' is not an integer"):
        detect({"RANK": "0", "WORLD_SIZE": "two"})


def test_init_distributed_raises_before_any_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed import comm as dist

    assert not dist.is_initialized()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS", raising=False)
    with pytest.raises(LaunchEnvError, match="incomplete SLURM .srun. environment: SLURM_LOCALID, SLURM_PROCID set"):
        dist.init_distributed(dist_backend="gloo", verbose=False)
    assert not dist.is_initialized()
    # Two tasks on two nodes that cannot tell where task 0 runs: a clear error, not a hang.
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "1")
    with pytest.raises(LaunchEnvError, match="export MASTER_ADDR"):
        dist.init_distributed(dist_backend="gloo", verbose=False)
    assert not dist.is_initialized()


def _slurm_task(report_dir: Path, rank: int, port: int, **extra: str) -> dict[str, str]:
    return clean_env(
        report_dir,
        SLURM_PROCID=str(rank),
        SLURM_NTASKS="2",
        SLURM_LOCALID=str(rank),
        SLURM_NTASKS_PER_NODE="2",
        SLURM_JOB_ID="4242",
        MASTER_PORT=str(port),
        **extra,
    )


def test_two_simulated_srun_tasks_train_one_world(tmp_path: Path) -> None:
    port = free_port()
    # SLURM_NODELIST's first host is where srun puts task 0; here it is this machine.
    run_all([(python_step(), _slurm_task(tmp_path, r, port, SLURM_NODELIST="localhost,node[02-03]")) for r in range(2)])
    got = assert_trained_world(tmp_path)
    assert [(r["local_rank"], r["master_addr"], r["master_port"]) for r in got] == [
        (0, "localhost", str(port)),
        (1, "localhost", str(port)),
    ]


def test_existing_process_group_with_dist_init_required_false(tmp_path: Path) -> None:
    # The user (or Lightning, accelerate...) created the group; initialize adopts it.
    port = free_port()
    run_all(
        [
            (
                python_step("--existing-group", "--stage", "3"),
                clean_env(
                    tmp_path,
                    RANK=str(r),
                    WORLD_SIZE="2",
                    LOCAL_RANK=str(r),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                ),
            )
            for r in range(2)
        ]
    )
    assert_trained_world(tmp_path)


def test_deepspeed_launcher_two_cpu_ranks(tmp_path: Path) -> None:
    argv = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        TRAIN_STEP,
        "--stage",
        "3",
    ]
    run_all([(argv, clean_env(tmp_path))])
    got = assert_trained_world(tmp_path)
    assert [r["local_rank"] for r in got] == [0, 1]
