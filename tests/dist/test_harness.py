"""Self-tests of tests/_harness.py: results, failures, deaths and stalls surface quickly, and no rank survives."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from deepspeed import comm as dist
from tests._harness import DistributedTest, DistributedTestError, DistributedTimeout, run_distributed


def _rank_square(offset: int) -> int:
    return dist.get_rank() ** 2 + offset


def _fail_on_rank_one() -> None:
    assert dist.get_rank() != 1, "rank one refuses"


def _exit_on_rank_one() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()  # rank 0 would wait here forever without the harness


def _hang_on_rank_one(pid_dir: str) -> None:
    Path(pid_dir, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    if dist.get_rank() == 1:
        time.sleep(600)
    dist.barrier()


def _unpicklable_result() -> object:
    return lambda: None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child that is not yet reaped is a zombie: dead for our purposes.
    with open(f"/proc/{pid}/stat") as fd:
        return fd.read().split(")")[-1].split()[0] != "Z"


def test_results_come_back_in_rank_order() -> None:
    assert run_distributed(_rank_square, 3, 7) == [7, 8, 11]


def test_failing_rank_surfaces_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="rank 1 failed") as info:
        run_distributed(_fail_on_rank_one, 2, timeout=30)
    assert "rank one refuses" in str(info.value) and "_fail_on_rank_one" in str(info.value)
    assert time.monotonic() - start < 10


def test_dead_rank_fails_fast() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="rank 1 exited with code 3"):
        run_distributed(_exit_on_rank_one, 2, timeout=30)
    assert time.monotonic() - start < 10


def test_stalled_rank_times_out_and_every_rank_is_killed(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTimeout, match=r"ranks \[0, 1\] did not finish within 3s"):
        run_distributed(_hang_on_rank_one, 2, str(tmp_path), timeout=3)
    assert time.monotonic() - start < 10
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)


def test_rejects_non_module_level_functions() -> None:
    with pytest.raises(TypeError, match="module-level"):
        run_distributed(lambda: None, 1)


def test_rejects_unpicklable_arguments_and_results() -> None:
    with pytest.raises(TypeError, match="picklable"):
        run_distributed(_rank_square, 1, lambda: None)
    with pytest.raises(DistributedTestError, match="rank 0 failed"):
        run_distributed(_unpicklable_result, 1)


class TestDistributedTestClass(DistributedTest):
    """The class mechanism: methods run inside the ranks, once per listed world size."""

    world_size = [1, 2]

    def test_runs_inside_ranks(self) -> None:
        assert dist.is_initialized() and dist.get_world_size() == self.world_size
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == self.world_size

    @pytest.mark.world_size(4)
    def test_marker_overrides_class_size(self, tmp_path: Path) -> None:
        assert self.world_size == 4 and dist.get_world_size() == 4
        (tmp_path / f"rank{dist.get_rank()}").touch()  # fixtures are shared by all ranks
        dist.barrier()
        assert len(list(tmp_path.iterdir())) == 4


@pytest.mark.world_size(2)
def test_marker_on_plain_function() -> None:
    assert dist.get_world_size() == 2


def test_class_and_marker_tests_were_parametrized(request: pytest.FixtureRequest) -> None:
    names = {item.name for item in request.session.items}
    here = {n for n in names if "runs_inside_ranks" in n or "marker_" in n}
    expected = {
        "test_runs_inside_ranks[ws1]",
        "test_runs_inside_ranks[ws2]",
        "test_marker_overrides_class_size[ws4]",
        "test_marker_on_plain_function[ws2]",
    }
    if not expected & names:
        pytest.skip("the distributed examples were deselected")
    assert expected <= here
