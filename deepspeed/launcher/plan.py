"""Turn parsed ``deepspeed`` arguments into a frozen :class:`LaunchPlan`, before anything is spawned.

Every check that can reject the command line runs here, so a bad hostfile, filter, port or script path
fails with one line and no process started. The functions are pure except where their docstring says
otherwise (reading the hostfile and ``.deepspeed_env`` files, binding a socket, asking ssh).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from deepspeed.launcher.constants import SLURM_LAUNCHER
from deepspeed.launcher.hostfile import encode_world_info, fetch_hostfile, parse_inclusion_exclusion
from deepspeed.launcher.local_accelerator import (
    CPU_ACCELERATOR_NAME,
    _local_device_count,
    accelerator_export_envs,
    visible_devices_env,
)
from deepspeed.launcher.multinode_runner import RUNNERS, launch_flags
from deepspeed.launcher.numa import parse_core_list, require_numactl

DLTS_HOSTFILE = "/job/hostfile"
EXPORT_ENVS = ["MLFLOW", "PYTHON", "MV2", "UCX"]
# Variables Nebula (Azure ML checkpointing) reads on every node.
NEBULA_EXPORT_ENVS = [
    "NEBULA_PERSISTENT_STORAGE_PATH", "NEBULA_PERSISTENT_TIME_INTERVAL", "AML_RUN_ID", "AZUREML_RUN_TOKEN",
    "AZUREML_WORKSPACE_SCOPE", "AZUREML_EXPERIMENT_SCOPE", "AZUREML_RUN_HISTORY_SERVICE_ENDPOINT",
    "AZUREML_RUN_ID", "NEBULA_MEMORY_BUFFER_SIZE", "AZUREML_PARAMETER_ITPJOB_NAME", "FC_TASKROLE_NAME",
    "FC_TASK_INDEX", "MASTER_HOST", "LOCAL_HOST", "AZUREML_BLOB_ACCOUNT_NAME", "AZUREML_BLOB_ACCOUNT_KEY",
]  # fmt: skip
EXPORT_ENVS += NEBULA_EXPORT_ENVS
# When the key is set in the launching environment, the listed variables must not be exported:
# they describe the launching machine's network, not the workers'.
EXCLUDE_ENVS = {"AISC_JOB_NAME": ["NCCL_IB_HCA", "UCX_NET_DEVICES"]}
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]

LOCAL_RUNNER = "local"
SSH_TIMEOUT_SECONDS = 30


class LaunchInputError(ValueError):
    """The command line, hostfile or environment cannot be launched; the message says why, in one line."""


@dataclass(frozen=True)
class LaunchPlan:
    """Everything needed to start a job, decided before anything runs (``--dry_run`` prints it)."""

    resources: Mapping[str, tuple[int, ...]]
    """Active ``{host: slot ids}``; host order, then slot order, is global rank order."""
    master_addr: str
    master_port: int
    runner: str
    """``"local"`` (this machine's per-node launcher) or a multi-node launcher name."""
    accelerator: str
    """``"cuda"``, ``"cpu"`` (CPU processes over gloo) or ``"per-node"`` (each node decides)."""
    command: tuple[str, ...]
    env: Mapping[str, str] = field(repr=False)
    exports: Mapping[str, str] = field(default_factory=dict)
    kill_command: tuple[str, ...] = ()
    files: Mapping[str, str] = field(default_factory=dict)
    """Files to write before running (MVAPICH's host list)."""
    notes: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return sum(len(slots) for slots in self.resources.values())


def validate_args(args: argparse.Namespace) -> None:
    """Reject flag combinations that cannot work, without touching the file system or network.

    Raises:
        LaunchInputError: naming the offending flag(s).
    """
    if args.include and args.exclude:
        raise LaunchInputError("--include and --exclude are mutually exclusive")
    if (args.num_nodes >= 0 or args.num_gpus >= 0) and (args.include or args.exclude):
        raise LaunchInputError("--num_nodes/--num_gpus cannot be combined with --include/--exclude")
    for flag in ("num_nodes", "num_gpus"):
        if getattr(args, flag) == 0 or getattr(args, flag) < -1:
            raise LaunchInputError(f"--{flag} must be a positive integer, got {getattr(args, flag)}")
    if args.module and args.no_python:
        raise LaunchInputError("--module and --no_python are mutually exclusive")
    if not 0 < args.master_port < 65536:
        raise LaunchInputError(f"--master_port must be in 1..65535, got {args.master_port}")
    if args.autotuning:
        raise LaunchInputError("--autotuning is not supported by deepspeed-lean")
    if args.elastic_training:
        raise LaunchInputError("--elastic_training is not supported by deepspeed-lean")
    if args.bind_core_list is not None:
        if not args.bind_cores_to_rank:
            raise LaunchInputError("--bind_core_list needs --bind_cores_to_rank")
        try:
            parse_core_list(args.bind_core_list)
        except ValueError as err:
            raise LaunchInputError(str(err)) from None
    if not (args.module or args.no_python) and not os.path.isfile(args.user_script):
        raise LaunchInputError(
            f"user script {args.user_script!r} does not exist (use --module or --no_python for non-files)"
        )


def _read_resource_pool(args: argparse.Namespace) -> OrderedDict[str, int] | None:
    """The hostfile's pool, or ``None`` for "this machine only". Reads the file system."""
    if args.hostfile != DLTS_HOSTFILE and not os.path.isfile(args.hostfile):
        # Only the default path may be absent: an explicit path that is missing is a typo, not a request
        # to run locally.
        raise LaunchInputError(f"hostfile {args.hostfile!r} does not exist")
    return fetch_hostfile(args.hostfile)


def _visible_devices_include(args: argparse.Namespace, visible: str, notes: list[str]) -> str:
    """Upstream's rule: a set CUDA_VISIBLE_DEVICES becomes ``--include localhost:<list>``."""
    if not visible:
        return args.include
    if args.include or args.exclude or args.num_nodes > 1 or args.num_gpus > 0:
        notes.append(f"ignoring {visible_devices_env()}={visible}: --include/--exclude/--num_gpus/--num_nodes given")
        return args.include
    notes.append(f"{visible_devices_env()}={visible} converted to --include localhost:{visible}")
    return f"localhost:{visible}"


def resolve_resources(
    args: argparse.Namespace, pool: Mapping[str, int] | None, device_count: int, visible: str = ""
) -> tuple[OrderedDict[str, list[int]], str, tuple[str, ...]]:
    """Decide which ``{host: slots}`` run a rank.

    Args:
        args: parsed runner arguments.
        pool: the hostfile's ``{host: slot count}``, or ``None`` to use this machine.
        device_count: local CUDA devices (only used without a hostfile); 0 selects CPU processes,
            ``--num_gpus`` of them, else one.
        visible: the CUDA_VISIBLE_DEVICES value the runner was started with ("" when unset).

    Returns:
        ``(active resources, accelerator kind, notes for the user)``.

    Raises:
        LaunchInputError: a filter names an unknown host or slot, or counts exceed what exists.
    """
    notes: list[str] = []
    include, accelerator = args.include, "per-node"
    if pool is None:
        if args.num_nodes > 1:
            raise LaunchInputError(f"--num_nodes {args.num_nodes} needs a hostfile (-H) listing the other nodes")
        if device_count > 0:
            include = _visible_devices_include(args, visible, notes)
            pool, accelerator = OrderedDict(localhost=device_count), "cuda"
        else:
            procs = max(args.num_gpus, 1)
            pool, accelerator = OrderedDict(localhost=procs), CPU_ACCELERATOR_NAME
            notes.append(f"no GPU found: starting {procs} CPU process(es) with DS_ACCELERATOR=cpu (gloo)")
    try:
        active = parse_inclusion_exclusion(pool, include, args.exclude)
    except ValueError as err:
        raise LaunchInputError(str(err)) from None
    if args.num_nodes > 0:
        if args.num_nodes > len(active):
            raise LaunchInputError(f"--num_nodes {args.num_nodes} but only {len(active)} host(s) available")
        active = OrderedDict(list(active.items())[: args.num_nodes])
    if args.num_gpus > 0:
        short = [host for host, count in pool.items() if host in active and count < args.num_gpus]
        if short:
            raise LaunchInputError(f"--num_gpus {args.num_gpus} exceeds the slots of host(s) {short}")
        active = OrderedDict((host, list(range(args.num_gpus))) for host in active)
    if not active:
        raise LaunchInputError("no host/slot left to run on after applying --include/--exclude")
    return active, accelerator, tuple(notes)


def check_port_free(port: int) -> None:
    """Fail now rather than at rank 0's rendezvous when ``port`` is taken. Binds a socket.

    SO_REUSEADDR, as the rendezvous store sets it, so a port left in TIME_WAIT by the previous run
    still counts as free.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as err:
            raise LaunchInputError(f"--master_port {port} is already in use on this machine ({err.strerror})") from None


def local_launch_command(
    args: argparse.Namespace, world_info: str, master_addr: str, runner_pid: int, node_rank: int | None = None
) -> list[str]:
    """``python -u -m deepspeed.launcher.launch ...`` for this machine; user script and args untouched."""
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}"]
    if node_rank is not None:
        cmd.append(f"--node_rank={node_rank}")
    cmd += [f"--master_addr={master_addr}", f"--master_port={args.master_port}"]
    return cmd + launch_flags(args, runner_pid) + [args.user_script, *args.user_args]


def parse_env_lines(lines: Sequence[str], source: str) -> OrderedDict[str, str]:
    """``KEY=VAL`` lines of a ``.deepspeed_env`` file; blank and ``#`` lines skipped.

    Raises:
        LaunchInputError: a line without ``=`` or with an empty key, naming ``source`` and the line.
    """
    found: OrderedDict[str, str] = OrderedDict()
    for lineno, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise LaunchInputError(f"{source}:{lineno}: expected KEY=VALUE, got {line!r}")
        found[key.strip()] = value.strip()
    return found


def read_env_files() -> OrderedDict[str, str]:
    """Variables from ``.deepspeed_env`` in the home then the current directory (later wins). Reads files."""
    found: OrderedDict[str, str] = OrderedDict()
    for directory in DEEPSPEED_ENVIRONMENT_PATHS:
        path = os.path.join(directory, DEEPSPEED_ENVIRONMENT_NAME)
        if os.path.isfile(path):
            with open(path) as fd:
                found.update(parse_env_lines(fd.readlines(), path))
    return found


def collect_exports(
    environ: Mapping[str, str], prefixes: Sequence[str], env_file_vars: Mapping[str, str]
) -> OrderedDict[str, str]:
    """Variables to set on every node: ``environ`` entries whose name starts with a prefix, then file ones."""
    excluded = {name for key, names in EXCLUDE_ENVS.items() if key in environ for name in names}
    exports = OrderedDict(
        (name, value) for name, value in environ.items() if name.startswith(tuple(prefixes)) and name not in excluded
    )
    exports.update(env_file_vars)
    return exports


def with_cwd_on_pythonpath(environ: Mapping[str, str], cwd: str) -> dict[str, str]:
    """Copy of ``environ`` with ``cwd`` first on PYTHONPATH, so remote nodes import the same local modules."""
    env = dict(environ)
    env["PYTHONPATH"] = f"{cwd}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else cwd
    return env


def _count_local_devices(visible_env: str) -> int:
    """Count CUDA devices with ``visible_env`` unset, then put it back. Imports torch via the accelerator.

    Without the restriction, ``--include localhost:2,3`` derived from ``CUDA_VISIBLE_DEVICES=2,3``
    names real device ids; with it, torch would see (and cache) only two devices numbered 0 and 1.
    """
    saved = os.environ.pop(visible_env, None)
    try:
        return _local_device_count()
    finally:
        if saved is not None:
            os.environ[visible_env] = saved


def _check_passwordless_ssh(host: str, ssh_port: int | None) -> None:
    """Fail fast when ``host`` cannot be reached by ssh without a password. Runs ssh."""
    port = ["-p", str(ssh_port)] if ssh_port else []
    cmd = ["ssh", "-o", "PasswordAuthentication=no", "-o", "BatchMode=yes", *port, host, "hostname"]
    try:
        subprocess.run(
            cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=SSH_TIMEOUT_SECONDS
        )
    except (subprocess.SubprocessError, OSError):
        raise LaunchInputError(
            f"cannot ssh to {host} without a password (needed by the launcher); fix ssh keys or pass --no_ssh_check"
        ) from None


def _discover_master_addr(host: str, ssh_port: int | None) -> str:
    """First address ``hostname -I`` reports on ``host``. Runs ssh."""
    port = ["-p", str(ssh_port)] if ssh_port else []
    try:
        out = subprocess.run(
            ["ssh", *port, host, "hostname", "-I"],
            check=True,
            capture_output=True,
            text=True,
            timeout=SSH_TIMEOUT_SECONDS,
        ).stdout.split()
    except (subprocess.SubprocessError, OSError):
        out = []
    if not out:
        raise LaunchInputError(f"could not learn {host}'s address with 'ssh {host} hostname -I'; pass --master_addr")
    return out[0]


def _local_plan(
    args: argparse.Namespace,
    env: dict[str, str],
    active: OrderedDict[str, list[int]],
    accelerator: str,
    notes: tuple[str, ...],
    runner_pid: int,
) -> LaunchPlan:
    """Plan for running the per-node launcher here: one node, or this node of a ``--no_ssh`` job."""
    node_rank = None
    master_addr = args.master_addr or "127.0.0.1"
    if len(active) > 1 or args.force_multi:  # --no_ssh: every node runs `deepspeed` itself
        if not 0 <= args.node_rank < len(active):
            raise LaunchInputError(f"--no_ssh needs --node_rank in 0..{len(active) - 1}, got {args.node_rank}")
        if not args.master_addr:
            raise LaunchInputError("--no_ssh with several nodes needs --master_addr")
        node_rank = args.node_rank
    else:
        check_port_free(args.master_port)
        if next(iter(active)) != "localhost":
            notes += (f"one host ({next(iter(active))}) in the hostfile: running it on this machine",)
    if args.no_python and shutil.which(args.user_script) is None:
        raise LaunchInputError(f"--no_python program {args.user_script!r} is not an executable on PATH")
    if args.bind_cores_to_rank:
        try:
            require_numactl()
        except ValueError as err:
            raise LaunchInputError(str(err)) from None
    command = local_launch_command(args, encode_world_info(active), master_addr, runner_pid, node_rank)
    return LaunchPlan(
        resources=_freeze(active), master_addr=master_addr, master_port=args.master_port, runner=LOCAL_RUNNER,
        accelerator=accelerator, command=tuple(command), env=MappingProxyType(env), notes=notes,
    )  # fmt: skip


def _multi_node_plan(
    args: argparse.Namespace, env: dict[str, str], active: OrderedDict[str, list[int]], dry_run: bool
) -> LaunchPlan:
    """Plan for reaching every node through pdsh, an MPI launcher or srun. May run ssh (not on a dry run)."""
    notes: list[str] = []
    first_host = next(iter(active))
    runner_cls = RUNNERS[args.launcher]
    try:
        runner_cls(args, "").validate_args(active)
    except ValueError as err:
        raise LaunchInputError(str(err)) from None
    if not dry_run and not runner_cls(args, "").backend_exists():
        raise LaunchInputError(f"launcher {args.launcher!r} is not installed on this machine")
    if not dry_run and args.launcher != SLURM_LAUNCHER and not args.no_ssh_check:
        _check_passwordless_ssh(first_host, args.ssh_port)
    master_addr = args.master_addr
    if not master_addr and dry_run:
        master_addr = first_host
        notes.append(f"master address would be the first of 'ssh {first_host} hostname -I'; shown as {first_host}")
    elif not master_addr:
        master_addr = _discover_master_addr(first_host, args.ssh_port)
    runner = runner_cls(argparse.Namespace(**{**vars(args), "master_addr": master_addr}), encode_world_info(active))
    env = with_cwd_on_pythonpath(env, os.path.abspath("."))
    exports = collect_exports(env, EXPORT_ENVS + accelerator_export_envs(), read_env_files())
    for key, value in exports.items():
        runner.add_export(key, value)
    cmd = runner.get_cmd(env, active)
    return LaunchPlan(
        resources=_freeze(active), master_addr=master_addr, master_port=args.master_port, runner=args.launcher,
        accelerator="per-node", command=cmd.argv, env=MappingProxyType(dict(cmd.env)),
        exports=MappingProxyType(dict(runner.exports)), kill_command=cmd.kill_argv,
        files=MappingProxyType(dict(cmd.files)), notes=tuple(notes),
    )  # fmt: skip


def _freeze(active: Mapping[str, list[int]]) -> Mapping[str, tuple[int, ...]]:
    return MappingProxyType(OrderedDict((host, tuple(slots)) for host, slots in active.items()))


def build_launch_plan(
    args: argparse.Namespace, environ: Mapping[str, str], runner_pid: int, dry_run: bool = False
) -> LaunchPlan:
    """Validate ``args`` against the hostfile, this machine and ``environ``; return what to run.

    Args:
        args: parsed runner arguments (see ``deepspeed.launcher.runner.parse_args``).
        environ: the environment the job inherits (normally ``os.environ``).
        runner_pid: pid recorded by ``--save_pid``.
        dry_run: skip everything that contacts other hosts (ssh checks, address discovery, tool lookup).

    Raises:
        LaunchInputError: anything that would make the launch fail; nothing has been started.
    """
    validate_args(args)
    try:
        pool = _read_resource_pool(args)
    except ValueError as err:
        raise LaunchInputError(str(err)) from None
    env = dict(environ)
    visible, device_count = "", 0
    if pool is None:
        visible = env.pop(visible_devices_env(), "")
        device_count = _count_local_devices(visible_devices_env())
    active, accelerator, notes = resolve_resources(args, pool, device_count, visible)
    if accelerator == CPU_ACCELERATOR_NAME:
        env.setdefault("DS_ACCELERATOR", CPU_ACCELERATOR_NAME)
    if (len(active) > 1 or args.force_multi) and not args.no_ssh:
        plan = _multi_node_plan(args, env, active, dry_run)
        return replace(plan, notes=notes + plan.notes)
    return _local_plan(args, env, active, accelerator, notes, runner_pid)
