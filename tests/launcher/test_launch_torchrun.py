"""torchrun starts two CPU ranks of ``fixtures/train_step.py``: on one node, and as two "nodes" (one rank each)
meeting at a c10d rendezvous on 127.0.0.1. Both must come up as ranks 0 and 1 of a world of 2 and take a step equal
to the single-process reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.launcher._launch import TRAIN_STEP, assert_trained_world, clean_env, free_port, run_all

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def test_torchrun_one_node(tmp_path: Path) -> None:
    argv = [
        *TORCHRUN,
        "--nnodes",
        "1",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        TRAIN_STEP,
    ]
    run_all([(argv, clean_env(tmp_path))])
    got = assert_trained_world(tmp_path)
    assert [r["local_rank"] for r in got] == [0, 1]


def test_torchrun_two_nodes_c10d_rendezvous(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    node = [
        *TORCHRUN,
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        endpoint,
        "--rdzv_id",
        "lean-two-nodes",
        TRAIN_STEP,
    ]
    run_all([(node, clean_env(tmp_path)), (node, clean_env(tmp_path))])
    got = assert_trained_world(tmp_path)
    assert [r["local_rank"] for r in got] == [0, 0]  # one rank per "node"
