"""Launch planning: resource resolution, CPU fallback, exports, and the bad-input checks (in-process)."""

from __future__ import annotations

import ast
import os
import socket
from collections import OrderedDict
from pathlib import Path

import pytest

from deepspeed.launcher import plan as plan_mod
from deepspeed.launcher.plan import (
    LaunchInputError,
    build_launch_plan,
    collect_exports,
    parse_env_lines,
    resolve_resources,
    with_cwd_on_pythonpath,
)
from deepspeed.launcher.runner import parse_args


@pytest.fixture(autouse=True)
def _default_port_is_free(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan tests must not depend on whether something else on the machine holds port 29500 right now.

    The one test about busy ports binds a port of its own and keeps the real check.
    """
    if request.node.name != "test_port_in_use_rejected_for_local_launch":
        monkeypatch.setattr(plan_mod, "check_port_free", lambda port: None)


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("pass\n")
    return str(path)


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> list[str | None]:
    """Pretend this machine has ``count`` CUDA devices; record CUDA_VISIBLE_DEVICES at count time."""
    seen: list[str | None] = []

    def fake_count() -> int:
        seen.append(os.environ.get("CUDA_VISIBLE_DEVICES"))
        return count

    monkeypatch.setattr(plan_mod, "_local_device_count", fake_count)
    return seen


def test_cpu_fallback_defaults_to_one_process(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 0)
    plan = build_launch_plan(parse_args([script]), {}, runner_pid=1)
    assert (plan.runner, plan.accelerator, dict(plan.resources)) == ("local", "cpu", {"localhost": (0,)})
    assert plan.env["DS_ACCELERATOR"] == "cpu"


def test_cpu_fallback_num_gpus_starts_that_many(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 0)
    plan = build_launch_plan(parse_args(["--num_accelerators", "3", script]), {"DS_ACCELERATOR": "xla"}, 1)
    assert dict(plan.resources) == {"localhost": (0, 1, 2)} and plan.world_size == 3
    assert plan.env["DS_ACCELERATOR"] == "xla"  # a user's choice is kept


def test_local_command_shape(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 2)
    args = parse_args(["--master_port", "29777", "--no_local_rank", "--save_pid", "--module", "pkg.train", "--x", "1"])
    plan = build_launch_plan(args, {}, runner_pid=4242)
    cmd = list(plan.command)
    assert cmd[1:4] == ["-u", "-m", "deepspeed.launcher.launch"]
    assert cmd[4].startswith("--world_info=")
    assert cmd[5:] == ["--master_addr=127.0.0.1", "--master_port=29777", "--module", "--no_local_rank",
                       "--save_pid=4242", "pkg.train", "--x", "1"]  # fmt: skip
    assert plan.accelerator == "cuda" and "DS_ACCELERATOR" not in plan.env


def test_visible_devices_become_include_and_leave_env(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _gpus(monkeypatch, 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    plan = build_launch_plan(parse_args([script]), dict(os.environ), 1)
    assert seen == [None]  # counted without the restriction ...
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"  # ... which is then restored for the caller
    assert dict(plan.resources) == {"localhost": (2, 3)}
    assert "CUDA_VISIBLE_DEVICES" not in plan.env
    assert any("converted to --include localhost:2,3" in note for note in plan.notes)


def test_visible_devices_ignored_with_num_gpus(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 4)
    plan = build_launch_plan(parse_args(["--num_gpus", "1", script]), {"CUDA_VISIBLE_DEVICES": "3"}, 1)
    assert dict(plan.resources) == {"localhost": (0,)}
    assert any("ignoring CUDA_VISIBLE_DEVICES=3" in note for note in plan.notes)


def _args(*argv: str) -> object:
    return parse_args(list(argv) + ["train.py"])


def test_resolve_num_nodes_and_num_gpus() -> None:
    pool = OrderedDict(a=4, b=4, c=4)
    active, kind, _ = resolve_resources(_args("--num_nodes", "2", "--num_gpus", "2"), pool, 0)
    assert (list(active.items()), kind) == ([("a", [0, 1]), ("b", [0, 1])], "per-node")
    with pytest.raises(LaunchInputError, match="--num_nodes 4 but only 3 host"):
        resolve_resources(_args("--num_nodes", "4"), pool, 0)
    with pytest.raises(LaunchInputError, match="exceeds the slots"):
        resolve_resources(_args("--num_gpus", "5"), pool, 0)
    with pytest.raises(LaunchInputError, match="needs a hostfile"):
        resolve_resources(_args("--num_nodes", "2"), None, 0)


def test_resolve_filter_errors_are_launch_errors() -> None:
    with pytest.raises(LaunchInputError, match="host 'z' is not in the resource pool"):
        resolve_resources(_args("-i", "z"), OrderedDict(a=1), 0)
    with pytest.raises(LaunchInputError, match="slot 3 is not available on host 'localhost'"):
        resolve_resources(_args("-i", "localhost:3"), None, 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-i", "a", "-e", "b"], "mutually exclusive"),
        (["-i", "a", "--num_gpus", "2"], "cannot be combined"),
        (["--num_gpus", "0"], "--num_gpus must be a positive integer"),
        (["--module", "--no_python"], "--module and --no_python"),
        (["--master_port", "70000"], "--master_port must be in 1..65535"),
        (["--autotuning", "tune"], "--autotuning is not supported"),
        (["--elastic_training"], "--elastic_training is not supported"),
        (["--bind_core_list", "0-3"], "needs --bind_cores_to_rank"),
        (["--bind_cores_to_rank", "--bind_core_list", "3-1"], "descending"),
        (["-H", "/nonexistent/hosts"], "hostfile '/nonexistent/hosts' does not exist"),
    ],
)
def test_bad_flags_rejected(argv: list[str], message: str, script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 0)
    with pytest.raises(LaunchInputError, match=message):
        build_launch_plan(parse_args(argv + [script]), {}, 1)


def test_missing_script_rejected_unless_module_or_no_python(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 0)
    with pytest.raises(LaunchInputError, match="user script 'nope.py' does not exist"):
        build_launch_plan(parse_args(["nope.py"]), {}, 1)
    assert build_launch_plan(parse_args(["--no_python", "hostname"]), {}, 1).command[-1] == "hostname"


def test_port_in_use_rejected_for_local_launch(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 0)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(LaunchInputError, match=f"--master_port {port} is already in use"):
            build_launch_plan(parse_args(["--master_port", str(port), script]), {}, 1)


def test_collect_exports_prefixes_exclusions_and_files() -> None:
    environ = {
        "NCCL_DEBUG": "INFO",
        "PYTHONPATH": "/x",
        "HOME": "/root",
        "UCX_NET_DEVICES": "mlx5",
        "AISC_JOB_NAME": "j",
    }
    exports = collect_exports(environ, ["NCCL", "PYTHON", "UCX"], {"HF_HOME": "/cache", "NCCL_DEBUG": "WARN"})
    assert exports == OrderedDict([("NCCL_DEBUG", "WARN"), ("PYTHONPATH", "/x"), ("HF_HOME", "/cache")])


def test_env_file_lines() -> None:
    assert parse_env_lines(["A=1\n", "# c\n", "\n", "B = x=y \n"], "f") == OrderedDict(A="1", B="x=y")
    with pytest.raises(LaunchInputError, match=r"^f:2: expected KEY=VALUE"):
        parse_env_lines(["A=1", "oops"], "f")


def test_cwd_prepended_to_pythonpath() -> None:
    assert with_cwd_on_pythonpath({"PYTHONPATH": "/lib"}, "/work")["PYTHONPATH"] == "/work:/lib"
    assert with_cwd_on_pythonpath({}, "/work")["PYTHONPATH"] == "/work"


def test_no_python_program_must_be_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 0)
    with pytest.raises(LaunchInputError, match="--no_python program 'no-such-prog-xyz' is not an executable on PATH"):
        build_launch_plan(parse_args(["--no_python", "no-such-prog-xyz"]), {}, 1)


def test_launcher_modules_import_torch_only_lazily() -> None:
    """Only the accelerator probe may pull in torch, and only inside a function (it costs seconds)."""
    heavy = ("torch", "deepspeed.accelerator", "deepspeed.comm", "deepspeed.runtime")
    for path in sorted(Path(plan_mod.__file__).parent.glob("*.py")):
        for node in ast.parse(path.read_text()).body:  # module level only
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.startswith(heavy)], f"{path.name}:{node.lineno} imports {names}"
