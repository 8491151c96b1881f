"""The ``deepspeed`` command (also ``ds`` and ``deepspeed.pt``): plan a launch, then run it.

``main`` reads as the whole story: parse, plan (every check, nothing started), then either print the
plan (``--dry_run``) or run it and exit with the job's exit code. The planning lives in ``plan``, the
multi-node command lines in ``multinode_runner``, the per-node spawner in ``launch``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence

from deepspeed._foundation.logging import log_levels, logger
from deepspeed.launcher.constants import (  # noqa: F401  (re-exported: upstream callers import these from here)
    ELASTIC_TRAINING_ID_DEFAULT,
    IMPI_LAUNCHER,
    MPICH_LAUNCHER,
    MULTI_NODE_LAUNCHERS,
    MVAPICH_LAUNCHER,
    OPENMPI_LAUNCHER,
    PDSH_LAUNCHER,
    PDSH_MAX_FAN_OUT,
    SLURM_LAUNCHER,
    TORCH_DISTRIBUTED_DEFAULT_PORT,
)
from deepspeed.launcher.hostfile import (  # noqa: F401  (re-exported)
    _parse_hostfile,
    _stable_remove_duplicates,
    encode_world_info,
    fetch_hostfile,
    parse_inclusion_exclusion,
    parse_resource_filter,
)
from deepspeed.launcher.plan import (  # noqa: F401  (re-exported)
    DEEPSPEED_ENVIRONMENT_NAME,
    DEEPSPEED_ENVIRONMENT_PATHS,
    DLTS_HOSTFILE,
    EXCLUDE_ENVS,
    EXPORT_ENVS,
    NEBULA_EXPORT_ENVS,
    LaunchPlan,
    build_launch_plan,
)
from deepspeed.launcher.supervisor import Supervisor

KILL_COMMAND_TIMEOUT_SECONDS = 60
# Exported variables whose values are never printed (Azure ML exports tokens and storage keys).
_SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")


def _add_resource_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-H",
        "--hostfile",
        type=str,
        default=DLTS_HOSTFILE,
        help="file of 'hostname slots=N' lines; without it (default path absent) only this machine is used",
    )
    parser.add_argument(
        "-i", "--include", type=str, default="", help="hosts/slots to use, e.g. 'worker-0@worker-1:0,2'"
    )
    parser.add_argument("-e", "--exclude", type=str, default="", help="hosts/slots not to use, e.g. 'worker-1:0'")
    parser.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts of the hostfile")
    parser.add_argument("--min_elastic_nodes", type=int, default=-1, help="elastic training only (unsupported)")
    parser.add_argument("--max_elastic_nodes", type=int, default=-1, help="elastic training only (unsupported)")
    parser.add_argument(
        "--num_gpus",
        "--num_accelerators",
        type=int,
        default=-1,
        dest="num_gpus",
        help="processes per node (slots 0..N-1); with no GPU, N CPU processes",
    )
    parser.add_argument(
        "--master_port",
        type=int,
        default=TORCH_DISTRIBUTED_DEFAULT_PORT,
        help="port of the rendezvous on global rank 0",
    )
    parser.add_argument(
        "--master_addr",
        type=str,
        default="",
        help="address of global rank 0 (default: 127.0.0.1, or the first host's 'hostname -I')",
    )
    parser.add_argument("--node_rank", type=int, default=-1, help="this node's index; only with --no_ssh")


def _add_launcher_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--launcher",
        type=str.lower,
        default=PDSH_LAUNCHER,
        choices=MULTI_NODE_LAUNCHERS,
        help="multi-node launcher (case-insensitive)",
    )
    parser.add_argument("--launcher_args", type=str, default="", help="extra arguments for the multi-node launcher")
    parser.add_argument("--module", action="store_true", help="run user_script as a module (python -m)")
    parser.add_argument("--no_python", action="store_true", help="run user_script directly, not through Python")
    parser.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    parser.add_argument(
        "--no_ssh",
        action="store_true",
        help="run `deepspeed --node_rank=R` on every node yourself instead of reaching them by ssh",
    )
    parser.add_argument("--no_ssh_check", action="store_true", help="skip the passwordless-ssh check")
    parser.add_argument("--force_multi", action="store_true", help="use the multi-node launcher even for one node")
    parser.add_argument("--save_pid", action="store_true", help="write the node launcher's pid to /tmp/<pid>.deepspeed")
    parser.add_argument("--enable_each_rank_log", type=str, default="None", help="directory for one log file per rank")
    parser.add_argument("--autotuning", type=str, default="", choices=["tune", "run"], help="not supported")
    parser.add_argument("--elastic_training", action="store_true", help="not supported")
    parser.add_argument(
        "--bind_cores_to_rank", action="store_true", help="pin each rank to its share of cores (numactl)"
    )
    parser.add_argument("--bind_core_list", type=str, default=None, help="cores to share out, e.g. 0-15,32-47")
    parser.add_argument("--ssh_port", type=int, default=None, help="ssh port for pdsh and the checks")
    parser.add_argument("--venv_script", type=str, default=None, help="script each node sources before starting (pdsh)")
    parser.add_argument("--comment", type=str, default="", help="passed to srun --comment (slurm launcher)")
    parser.add_argument(
        "--log_level", type=str.lower, default="info", choices=sorted(log_levels), help="launcher log level"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="launcher logs errors only")
    parser.add_argument("--dry_run", action="store_true", help="print the launch plan and exit; start nothing")


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the ``deepspeed`` command line; everything from ``user_script`` on is kept verbatim."""
    parser = argparse.ArgumentParser(
        prog="deepspeed",
        description="Launch a DeepSpeed job on this machine's GPUs (or CPU processes) or on the hosts of a hostfile.",
    )
    _add_resource_args(parser)
    _add_launcher_args(parser)
    parser.add_argument("user_script", type=str, help="training script (or module, or program) every rank runs")
    parser.add_argument("user_args", nargs=argparse.REMAINDER, help="arguments passed unchanged to user_script")
    return parser.parse_args(args)


def _mask_secrets(text: str, exports: Mapping[str, str]) -> str:
    """Hide exported values whose names look secret (tokens, keys, passwords) before showing ``text``."""
    for key, value in exports.items():
        if value and any(word in key.upper() for word in _SECRET_WORDS):
            text = text.replace(value, "***")
    return text


def render_plan(plan: LaunchPlan) -> str:
    """Human-readable launch plan, as ``--dry_run`` prints it."""
    lines = [
        f"runner: {plan.runner}",
        f"accelerator: {plan.accelerator}",
        f"world_size: {plan.world_size}",
        "resources: " + " ".join(f"{host}:{','.join(map(str, slots))}" for host, slots in plan.resources.items()),
        f"master: {plan.master_addr}:{plan.master_port}",
    ]
    lines += [f"export: {key}={value}" for key, value in plan.exports.items()]
    lines += [f"file: {path}" for path in plan.files]
    lines += [f"note: {note}" for note in plan.notes]
    lines.append(f"command: {shlex.join(plan.command)}")
    return _mask_secrets("\n".join(lines), plan.exports)


def run_plan(plan: LaunchPlan) -> int:
    """Start ``plan.command``, supervise it, and return the exit code to propagate."""
    for path, content in plan.files.items():
        with open(path, "w") as fd:
            fd.write(content)
    logger.info(_mask_secrets(f"cmd = {shlex.join(plan.command)}", plan.exports))
    supervisor = Supervisor()
    supervisor.spawn(plan.runner, plan.command, plan.env)
    code = supervisor.wait()
    if supervisor.signalled and plan.kill_command:
        # pdsh does not reliably stop what it started remotely; ask every host to stop this job's launchers.
        subprocess.run(list(plan.kill_command), env=dict(plan.env), timeout=KILL_COMMAND_TIMEOUT_SECONDS, check=False)
    return code


def _set_log_level(args: argparse.Namespace) -> None:
    logger.setLevel(logging.ERROR if args.quiet else log_levels[args.log_level])


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of ``deepspeed``/``ds``: exits 2 on bad input, else with the job's exit code when non-zero."""
    opts = parse_args(args)
    _set_log_level(opts)
    try:
        plan = build_launch_plan(opts, os.environ, os.getpid(), dry_run=opts.dry_run)
    except ValueError as err:
        print(f"deepspeed: error: {err}", file=sys.stderr)
        sys.exit(2)
    if opts.dry_run:
        print(render_plan(plan))
        return
    code = run_plan(plan)
    if code != 0:
        sys.exit(code)


if __name__ == "__main__":
    main()
