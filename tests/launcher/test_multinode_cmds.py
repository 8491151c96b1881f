"""Multi-node command lines: each runner's argv is checked exactly (nothing is executed)."""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

from deepspeed.launcher import plan as plan_mod
from deepspeed.launcher.multinode_runner import (
    IMPIRunner,
    MPICHRunner,
    MVAPICHRunner,
    OpenMPIRunner,
    PDSHRunner,
    SlurmRunner,
)
from deepspeed.launcher.plan import LaunchInputError, build_launch_plan
from deepspeed.launcher.runner import encode_world_info, parse_args, render_plan

TWO_BY_TWO = OrderedDict([("w0", [0, 1]), ("w1", [0, 1])])
HELPER = [sys.executable, "-u", "-m", "deepspeed.launcher.launcher_helper"]


def _args(*flags: str) -> argparse.Namespace:
    args = parse_args([*flags, "--master_addr", "10.0.0.1", "--master_port", "6000", "train.py", "--lr", "1e-3", "a b"])
    return args


def _runner(cls: type, *flags: str) -> object:
    runner = cls(_args(*flags), encode_world_info(TWO_BY_TWO))
    runner.add_export("NCCL_DEBUG", "INFO")
    return runner


def test_pdsh_command() -> None:
    runner = _runner(PDSHRunner, "--launcher_args", "-R ssh", "--ssh_port", "2222", "--venv_script", "/v/act")
    cmd = runner.get_cmd({"PATH": "/bin"}, TWO_BY_TWO)
    wi = encode_world_info(TWO_BY_TWO)
    assert list(cmd.argv[:8]) == ["pdsh", "-S", "-f", "1024", "-w", "w0,w1", "-R", "ssh"]
    remote = list(cmd.argv[8:])
    assert remote[:3] == ["export NCCL_DEBUG=INFO;", "source /v/act;", f"cd {shlex.quote(os.path.abspath('.'))};"]
    assert remote[3:] == [shlex.quote(sys.executable), "-u", "-m", "deepspeed.launcher.launch", f"--world_info={wi}",
                          "--node_rank=%n", "--master_addr=10.0.0.1", "--master_port=6000",
                          "train.py", "--lr", "1e-3", "'a b'"]  # fmt: skip
    # The remote shell re-parses the joined line: the user's arguments must come back unchanged.
    assert shlex.split(" ".join(remote[3:]))[-3:] == ["--lr", "1e-3", "a b"]
    assert cmd.env["PDSH_RCMD_TYPE"] == "ssh" and cmd.env["PDSH_SSH_ARGS_APPEND"] == "-p 2222"
    assert list(cmd.kill_argv[-3:]) == ["pkill", "-f", f"'deepspeed.launcher.launch --world_info={wi}'"]


def test_pdsh_passes_launch_flags() -> None:
    cmd = _runner(PDSHRunner, "--no_local_rank", "--module", "--enable_each_rank_log", "/logs").get_cmd({}, TWO_BY_TWO)
    assert {"--module", "--no_local_rank", "--enable_each_rank_log=/logs"} <= set(cmd.argv)


def test_openmpi_command_and_limits() -> None:
    cmd = _runner(OpenMPIRunner, "-H", "/hf").get_cmd({}, TWO_BY_TWO)
    assert list(cmd.argv) == [
        "mpirun", "-n", "4", "-hostfile", "/hf", "--mca", "btl", "^openib", "--mca", "btl_tcp_if_include", "eth0",
        "-x", "NCCL_DEBUG=INFO", "-x", "MASTER_ADDR=10.0.0.1", "-x", "MASTER_PORT=6000", "-x", "WORLD_SIZE=4",
        *HELPER, "--launcher", "openmpi", "train.py", "--lr", "1e-3", "a b",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="does not support --include/--exclude"):
        _runner(OpenMPIRunner, "-i", "w0").validate_args(TWO_BY_TWO)
    with pytest.raises(ValueError, match="does not support --num_nodes/--num_gpus"):
        _runner(OpenMPIRunner, "--num_gpus", "1").validate_args(TWO_BY_TWO)


def test_mpich_command_and_limits() -> None:
    cmd = _runner(MPICHRunner, "--no_python").get_cmd({}, TWO_BY_TWO)
    assert list(cmd.argv) == [
        "mpirun", "-n", "4", "-ppn", "2", "-genv", "NCCL_DEBUG", "INFO", "-genv", "MASTER_ADDR", "10.0.0.1",
        "-genv", "MASTER_PORT", "6000", "-genv", "WORLD_SIZE", "4", "-genv", "LOCAL_SIZE", "2", "-hosts", "w0,w1",
        *HELPER, "--launcher", "mpich", "--no_python", "train.py", "--lr", "1e-3", "a b",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="same number of slots on every host"):
        _runner(MPICHRunner).validate_args(OrderedDict(w0=[0, 1], w1=[0]))
    with pytest.raises(ValueError, match="cannot select individual slots"):
        _runner(MPICHRunner).validate_args(OrderedDict(w0=[1], w1=[1]))


def test_impi_command_has_one_segment_per_rank() -> None:
    argv = list(_runner(IMPIRunner).get_cmd({}, TWO_BY_TWO).argv)
    assert argv.count(":") == 3
    first = argv.index("-n", argv.index("-hosts"))
    assert argv[first : first + 6] == ["-n", "1", "-env", "RANK", "0", "-env"]
    ranks = [argv[i + 1] for i, word in enumerate(argv) if word == "RANK"]
    local = [argv[i + 1] for i, word in enumerate(argv) if word == "LOCAL_RANK"]
    assert (ranks, local) == (["0", "1", "2", "3"], ["0", "1", "0", "1"])


def test_impi_core_binding_prefixes_numactl() -> None:
    argv = list(_runner(IMPIRunner, "--bind_cores_to_rank", "--bind_core_list", "0-7").get_cmd({}, TWO_BY_TWO).argv)
    assert argv[argv.index("I_MPI_PIN") - 1 :][:6] == ["-genv", "I_MPI_PIN", "0", "-genv", "OMP_NUM_THREADS", "4"]
    assert [argv[i + 2] for i, word in enumerate(argv) if word == "numactl"] == ["0-3", "4-7", "0-3", "4-7"]


def test_mvapich_command_writes_host_list() -> None:
    runner = _runner(MVAPICHRunner)
    cmd = runner.get_cmd({}, TWO_BY_TWO)
    assert list(cmd.argv[:8]) == [
        "mpirun",
        "-np",
        "4",
        "-ppn",
        "2",
        "--hostfile",
        "/tmp/deepspeed_mvapich_hostfile",
        "-env",
    ]
    assert runner.exports["MV2_USE_CUDA"] == "1" and "MV2_SMP_USE_CMA" in cmd.argv
    assert dict(cmd.files) == {"/tmp/deepspeed_mvapich_hostfile": "w0\nw1\n"}


def test_slurm_command() -> None:
    cmd = _runner(SlurmRunner, "--comment", "exp-1", "--launcher_args=--partition=gpu").get_cmd({}, TWO_BY_TWO)
    assert list(cmd.argv) == [
        "srun", "-n", "4", "--nodes=2", "--ntasks-per-node=2", "--nodelist=w0,w1", "--partition=gpu",
        "--comment", "exp-1", "--export=ALL,NCCL_DEBUG=INFO,MASTER_ADDR=10.0.0.1,MASTER_PORT=6000,WORLD_SIZE=4",
        *HELPER, "--launcher", "slurm", "train.py", "--lr", "1e-3", "a b",
    ]  # fmt: skip


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A 3-host hostfile, a script, and .deepspeed_env files in a fake home and the cwd."""
    (tmp_path / "hosts").write_text("# test cluster\nw0 slots=2\nw1 slots=2\nw2 slots=2\n")
    (tmp_path / "train.py").write_text("pass\n")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text("FROM_HOME=1\nSHARED=home\n")
    (tmp_path / ".deepspeed_env").write_text("SHARED=cwd\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(plan_mod, "DEEPSPEED_ENVIRONMENT_PATHS", [str(home), "."])
    monkeypatch.setattr(plan_mod, "accelerator_export_envs", lambda: ["NCCL"])
    return tmp_path


def test_dry_run_multi_node_plan(cluster: Path) -> None:
    args = parse_args(["-H", "hosts", "-e", "w1", "--launcher", "PDSH", "train.py", "--x"])
    plan = build_launch_plan(args, {"NCCL_IB_DISABLE": "1", "PYTHONPATH": "/lib", "SECRET": "s"}, 1, dry_run=True)
    assert (plan.runner, dict(plan.resources), plan.master_addr) == ("pdsh", {"w0": (0, 1), "w2": (0, 1)}, "w0")
    assert dict(plan.exports) == {
        "NCCL_IB_DISABLE": "1",
        "PYTHONPATH": f"{cluster}:/lib",
        "FROM_HOME": "1",
        "SHARED": "cwd",
    }
    assert plan.command[:6] == ("pdsh", "-S", "-f", "1024", "-w", "w0,w2") and plan.kill_command


def test_multi_node_plan_rejects_what_the_runner_cannot_do(cluster: Path) -> None:
    with pytest.raises(LaunchInputError, match="openmpi launcher does not support --include/--exclude"):
        build_launch_plan(parse_args(["-H", "hosts", "-i", "w0@w1", "--launcher", "openmpi", "train.py"]), {}, 1, True)
    with pytest.raises(LaunchInputError, match="--no_ssh needs --node_rank in 0..2"):
        build_launch_plan(parse_args(["-H", "hosts", "--no_ssh", "--master_addr", "w0", "train.py"]), {}, 1)


def test_no_ssh_runs_this_node_locally(cluster: Path) -> None:
    args = parse_args(["-H", "hosts", "--no_ssh", "--node_rank", "1", "--master_addr", "10.1.1.1", "train.py"])
    plan = build_launch_plan(args, {}, 1)
    assert plan.runner == "local" and "--node_rank=1" in plan.command and "--master_addr=10.1.1.1" in plan.command


def test_dry_run_masks_secret_exports(cluster: Path, capsys: pytest.CaptureFixture) -> None:
    env = {"AZUREML_RUN_TOKEN": "tok-123", "NCCL_DEBUG": "INFO"}
    args = parse_args(["-H", "hosts", "--launcher", "openmpi", "train.py"])
    text = render_plan(build_launch_plan(args, env, 1, dry_run=True))
    assert "tok-123" not in text and "export: AZUREML_RUN_TOKEN=***" in text
    assert "export: NCCL_DEBUG=INFO" in text and "-x AZUREML_RUN_TOKEN=***" in text


def test_single_host_hostfile_runs_locally(cluster: Path) -> None:
    (cluster / "one").write_text("w7 slots=2\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    plan = build_launch_plan(parse_args(["-H", "one", "--master_port", port, "train.py"]), {}, 1)
    assert plan.runner == "local" and dict(plan.resources) == {"w7": (0, 1)}
    assert any("running it on this machine" in note for note in plan.notes)
