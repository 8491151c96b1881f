"""Per-node spawner: ``python -m deepspeed.launcher.launch --world_info=<b64> ... script args``.

Started once per node by the ``deepspeed`` runner (directly, or through pdsh). It starts one process
per local slot with the rendezvous variables set, then supervises them: the first rank to fail stops
the others and decides the exit code; signals to this process reach every rank (see ``supervisor``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from deepspeed._foundation.logging import logger
from deepspeed.launcher.constants import PID_FILE_BASEPATH, TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.launcher.hostfile import decode_world_info
from deepspeed.launcher.local_accelerator import (
    CPU_ACCELERATOR_NAME,
    _local_device_count,
    visible_devices_env,
)
from deepspeed.launcher.numa import available_cores, cores_for_rank, numactl_prefix, parse_core_list, require_numactl
from deepspeed.launcher.supervisor import Supervisor


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the per-node launcher's command line; everything after the script is kept verbatim."""
    parser = argparse.ArgumentParser(description="DeepSpeed per-node launcher: starts this node's ranks")
    parser.add_argument("--node_rank", type=int, default=0, help="index of this node in --world_info")
    parser.add_argument("--master_addr", type=str, default="127.0.0.1", help="address of global rank 0")
    parser.add_argument("--master_port", type=int, default=TORCH_DISTRIBUTED_DEFAULT_PORT, help="rendezvous port")
    parser.add_argument("--world_info", type=str, default="None", help="URL-safe base64 JSON {host: [slot ids]}")
    parser.add_argument("--module", action="store_true", help="run the script as a module (python -m)")
    parser.add_argument("--no_python", action="store_true", help="run the script directly, not through Python")
    parser.add_argument("--enable_elastic_training", action="store_true", help="not supported by deepspeed-lean")
    parser.add_argument("--min_elastic_nodes", type=int, default=-1, help="elastic training only")
    parser.add_argument("--max_elastic_nodes", type=int, default=-1, help="elastic training only")
    parser.add_argument("--no_local_rank", action="store_true", help="do not append --local_rank=N to the script")
    parser.add_argument("--save_pid", type=int, default=0, help="write this launcher's pid to /tmp/<N>.deepspeed")
    parser.add_argument("--enable_each_rank_log", type=str, default="None", help="directory for one log file per rank")
    parser.add_argument(
        "--bind_cores_to_rank", action="store_true", help="pin each rank to its share of cores (numactl)"
    )
    parser.add_argument("--bind_core_list", type=str, default=None, help="cores to share out, e.g. 0-15,32-47")
    parser.add_argument("training_script", type=str, help="script (or module, or program) each rank runs")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="arguments passed unchanged")
    return parser.parse_args(args)


@dataclass(frozen=True)
class NodeLayout:
    """Where this node sits in the job: its slots and the global ranks they get."""

    node_rank: int
    num_nodes: int
    slots: tuple[int, ...]
    first_rank: int
    world_size: int


@dataclass(frozen=True)
class RankSpec:
    """One local rank to start."""

    global_rank: int
    local_rank: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    log_path: str | None


def node_layout(world_info: Mapping[str, list[int]], node_rank: int) -> NodeLayout:
    """Locate ``node_rank`` in ``world_info``: ranks are numbered host by host, in its order.

    Raises:
        ValueError: ``node_rank`` is not an index of ``world_info``.
    """
    hosts = list(world_info)
    if not 0 <= node_rank < len(hosts):
        raise ValueError(f"--node_rank {node_rank} out of range: world_info lists {len(hosts)} node(s)")
    first_rank = sum(len(world_info[host]) for host in hosts[:node_rank])
    world_size = sum(len(slots) for slots in world_info.values())
    return NodeLayout(node_rank, len(hosts), tuple(world_info[hosts[node_rank]]), first_rank, world_size)


def node_env(
    environ: Mapping[str, str], args: argparse.Namespace, layout: NodeLayout, has_gpus: bool
) -> dict[str, str]:
    """Variables shared by every rank of this node."""
    env = dict(environ)
    if has_gpus:
        env[visible_devices_env()] = ",".join(map(str, layout.slots))
    else:
        # No GPU here: the ranks must pick the CPU accelerator (gloo) unless the user chose otherwise.
        env.setdefault("DS_ACCELERATOR", CPU_ACCELERATOR_NAME)
    env.update(
        MASTER_ADDR=args.master_addr,
        MASTER_PORT=str(args.master_port),
        WORLD_SIZE=str(layout.world_size),
        CROSS_RANK=str(layout.node_rank),
        CROSS_SIZE=str(layout.num_nodes),
        LOCAL_SIZE=str(len(layout.slots)),
        LOCAL_WORLD_SIZE=str(len(layout.slots)),
    )
    return env


def rank_argv(args: argparse.Namespace, local_rank: int, python: str) -> list[str]:
    """``[python -u [-m]] script [--local_rank=N] user args`` for one rank."""
    cmd = [] if args.no_python else [python, "-u", *(["-m"] if args.module else [])]
    cmd.append(args.training_script)
    if not args.no_local_rank:
        # Before the user's arguments, as upstream does: scripts that stop parsing at a `--` still see it.
        cmd.append(f"--local_rank={local_rank}")
    return cmd + list(args.training_script_args)


def build_rank_specs(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    layout: NodeLayout,
    has_gpus: bool,
    cores: list[int] | None,
    timestamp: str,
) -> list[RankSpec]:
    """Everything needed to start this node's ranks; ``cores`` set means pin each rank with numactl."""
    shared = node_env(environ, args, layout, has_gpus)
    specs = []
    for local_rank in range(len(layout.slots)):
        rank = layout.first_rank + local_rank
        env = dict(shared, RANK=str(rank), LOCAL_RANK=str(local_rank))
        argv = rank_argv(args, local_rank, sys.executable)
        if cores is not None:
            mine = cores_for_rank(cores, len(layout.slots), local_rank)
            env["OMP_NUM_THREADS"] = str(len(mine))
            argv = numactl_prefix(mine) + argv
        elif "OMP_NUM_THREADS" not in environ:
            # Without a share each rank's intra-op pool takes every core and the ranks thrash (as
            # torchrun does, the user's own setting wins).
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, len(layout.slots))))
        log_path = None
        if args.enable_each_rank_log != "None":
            log_path = os.path.join(args.enable_each_rank_log, f"{timestamp}_rank{rank}.log")
        specs.append(RankSpec(rank, local_rank, tuple(argv), env, log_path))
    return specs


def _validate(args: argparse.Namespace) -> None:
    if args.module and args.no_python:
        raise ValueError("--module and --no_python are mutually exclusive")
    if args.enable_elastic_training:
        raise ValueError("--enable_elastic_training is not supported by deepspeed-lean")
    if args.world_info == "None":
        raise ValueError("--world_info is required")
    if args.bind_cores_to_rank:
        require_numactl()


def _binding_cores(args: argparse.Namespace) -> list[int] | None:
    if not args.bind_cores_to_rank:
        return None
    return parse_core_list(args.bind_core_list) if args.bind_core_list else available_cores()


def _write_pid_file(save_pid: int) -> str | None:
    """``/tmp/<runner pid>.deepspeed`` holding this launcher's pid, so tools can find and signal it."""
    if not save_pid:
        return None
    path = os.path.join(PID_FILE_BASEPATH, f"{save_pid}.deepspeed")
    with open(path, "w") as fd:
        fd.write(str(os.getpid()))
    return path


def _plan_ranks(args: argparse.Namespace) -> list[RankSpec]:
    """Validate and build this node's rank specs; raises ValueError before anything starts."""
    _validate(args)
    layout = node_layout(decode_world_info(args.world_info), args.node_rank)
    has_gpus = _local_device_count() > 0
    specs = build_rank_specs(args, os.environ, layout, has_gpus, _binding_cores(args), time.strftime("%Y%m%d%H%M%S"))
    if args.enable_each_rank_log != "None":
        os.makedirs(args.enable_each_rank_log, exist_ok=True)
    return specs


def _run_ranks(specs: list[RankSpec]) -> int:
    """Start every rank and supervise them; the exit code the node launcher should end with."""
    supervisor = Supervisor()
    logger.debug(f"starting ranks {specs[0].global_rank}..{specs[-1].global_rank}")
    try:
        for spec in specs:
            supervisor.spawn(f"rank {spec.global_rank}", spec.argv, spec.env, spec.log_path)
    except OSError as err:
        # spawn already stopped the ranks started before this one.
        print(f"deepspeed.launcher.launch: error: cannot start {spec.argv[0]!r}: {err.strerror}", file=sys.stderr)
        return 2
    return supervisor.wait()


def main(args: Sequence[str] | None = None) -> None:
    """Start this node's ranks, supervise them, and exit with the job's exit code."""
    opts = parse_args(args)
    try:
        specs = _plan_ranks(opts)
    except ValueError as err:
        print(f"deepspeed.launcher.launch: error: {err}", file=sys.stderr)
        sys.exit(2)
    pid_file = _write_pid_file(opts.save_pid)
    try:
        code = _run_ranks(specs)
    finally:
        if pid_file is not None and os.path.exists(pid_file):
            os.remove(pid_file)
    sys.exit(code)


if __name__ == "__main__":
    main()
