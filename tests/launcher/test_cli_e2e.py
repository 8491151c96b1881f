"""End-to-end: the real ``deepspeed`` command starting CPU ranks of ``fixtures/report_env.py``.

DS_ACCELERATOR=cpu is set for speed (the launcher then skips importing torch); one test leaves it
unset to exercise the accelerator probe.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from deepspeed.launcher import runner as runner_mod

FIXTURE = str(Path(__file__).parent / "fixtures" / "report_env.py")
RUNNER = [sys.executable, "-m", "deepspeed.launcher.runner"]
TIMEOUT = 90  # generous: a loaded 2-core machine imports torch slowly


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", REPORT_DIR=str(tmp_path), **extra)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _run(argv: list[str], env: dict[str, str], cmd: list[str] = RUNNER) -> subprocess.CompletedProcess:
    return subprocess.run(cmd + argv, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def _report(tmp_path: Path, rank: int) -> dict:
    return json.loads((tmp_path / f"rank{rank}.json").read_text())


def _wait_for(predicate: object, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_two_cpu_ranks_get_env_local_rank_and_logs(tmp_path: Path) -> None:
    port, log_dir = _free_port(), tmp_path / "logs"
    user_args = ["--lr", "0.1", "a b", "--num_gpus", "7", "--", "-H"]
    argv = ["--num_gpus", "2", "--master_port", str(port), "--enable_each_rank_log", str(log_dir), FIXTURE]
    done = _run(argv + user_args, _env(tmp_path))
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        report = _report(tmp_path, rank)
        assert report["argv"] == [f"--local_rank={rank}", *user_args]
        assert report["env"] == {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CROSS_RANK": "0", "CROSS_SIZE": "1",
            "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": None,
            # each rank gets an equal share of the cores unless the user set OMP_NUM_THREADS
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 2)),
        }  # fmt: skip
    logs = sorted(log_dir.iterdir())
    assert [p.name.split("_", 1)[1] for p in logs] == ["rank0.log", "rank1.log"]
    assert f"report_env rank 1 argv={['--local_rank=1', *user_args]}" in logs[1].read_text()


def test_default_is_one_cpu_process_without_local_rank(tmp_path: Path) -> None:
    env = _env(tmp_path)
    del env["DS_ACCELERATOR"]  # the real accelerator probe decides there is no GPU
    cmd = [shutil.which("deepspeed")] if shutil.which("deepspeed") else RUNNER
    done = _run(["--no_local_rank", "--master_port", str(_free_port()), FIXTURE, "x"], env, cmd)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.glob("rank*.json")) == ["rank0.json"]
    assert _report(tmp_path, 0)["argv"] == ["x"]
    assert _report(tmp_path, 0)["env"]["DS_ACCELERATOR"] == "cpu"


def test_failing_rank_stops_sibling_and_sets_exit_code(tmp_path: Path) -> None:
    env = _env(tmp_path, REPORT_FAIL_RANK="1", REPORT_FAIL_CODE="3", REPORT_SLEEP="120")
    start = time.monotonic()
    done = _run(["--num_gpus", "2", "--master_port", str(_free_port()), FIXTURE], env)
    assert done.returncode == 3, done.stderr
    assert time.monotonic() - start < 60  # did not wait for the sibling's 120 s sleep
    assert not psutil.pid_exists(_report(tmp_path, 0)["pid"])
    assert "rank 1 exited with code 3" in done.stdout + done.stderr


def test_sigterm_to_launcher_kills_every_descendant(tmp_path: Path) -> None:
    env = _env(tmp_path, REPORT_SLEEP="60", REPORT_SPAWN_CHILD="1")
    argv = ["--num_gpus", "2", "--save_pid", "--master_port", str(_free_port()), FIXTURE]
    proc = subprocess.Popen(RUNNER + argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(lambda: all((tmp_path / f"rank{r}.json").exists() for r in (0, 1)))
        family = psutil.Process(proc.pid).children(recursive=True)
        pid_file = Path(f"/tmp/{proc.pid}.deepspeed")
        launch = psutil.Process(proc.pid).children()[0]
        assert pid_file.read_text() == str(launch.pid)
        grandchildren = [_report(tmp_path, r)["grandchild_pid"] for r in (0, 1)]
        assert {p.pid for p in family} >= set(grandchildren) and len(family) == 5  # launch, 2 ranks, 2 sleeps
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(family, timeout=5)
        assert not alive, f"survivors: {alive}"
        assert not pid_file.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()


@pytest.fixture
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything is started; pretend there is no GPU."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process was spawned despite bad input")

    monkeypatch.setattr(runner_mod.Supervisor, "spawn", forbidden)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def _bad_input_cases(tmp_path: Path, busy_port: int) -> dict[str, tuple[list[str], str]]:
    """Case name -> (full command line, expected error text)."""
    (tmp_path / "bad_hosts").write_text("w0 slots=2\nw1 slots two\n")
    (tmp_path / "dup_hosts").write_text("w0 slots=2\nw0 slots=2\n")
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    cases = {
        "malformed hostfile": (["-H", str(tmp_path / "bad_hosts")], "hostfile line 2 is malformed: 'w1 slots two'"),
        "duplicate host": (["-H", str(tmp_path / "dup_hosts")], "host 'w0' is listed more than once"),
        "unknown host": (["-i", "nodeX"], "host 'nodeX' is not in the resource pool"),
        "unknown slot": (["-i", "localhost:5"], "slot 5 is not available on host 'localhost'"),
        "include and exclude": (["-i", "localhost", "-e", "localhost:0"], "--include and --exclude are mutually"),
        "port in use": (["--master_port", str(busy_port)], f"--master_port {busy_port} is already in use"),
    }
    full = {name: ([*flags, str(script)], message) for name, (flags, message) in cases.items()}
    full["missing script"] = (["--num_gpus", "2", str(tmp_path / "nope.py")], "nope.py' does not exist")
    return full


def test_bad_inputs_fail_before_spawning(tmp_path: Path, no_spawn: None, capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        for name, (argv, message) in _bad_input_cases(tmp_path, busy.getsockname()[1]).items():
            with pytest.raises(SystemExit) as exit_info:
                runner_mod.main(argv)
            err = capsys.readouterr().err
            assert exit_info.value.code == 2, name
            assert len(err.strip().splitlines()) == 1 and message in err, (name, err)
            assert err.startswith("deepspeed: error: "), (name, err)
            assert not list(tmp_path.glob("rank*.json"))


def test_dry_run_prints_plan_and_starts_nothing(tmp_path: Path, no_spawn: None, capsys: pytest.CaptureFixture) -> None:
    runner_mod.main(["--dry_run", "--num_gpus", "2", "--master_port", str(_free_port()), FIXTURE, "--a"])
    lines = capsys.readouterr().out.splitlines()
    for expected in ("runner: local", "accelerator: cpu", "world_size: 2", "resources: localhost:0,1"):
        assert expected in lines
    command = next(line for line in lines if line.startswith("command: "))
    assert "-m deepspeed.launcher.launch --world_info=" in command and command.endswith(f"{FIXTURE} --a")
