"""Command lines for multi-node launches: pure functions of the arguments, resources and exports.

Each runner turns the active ``{host: slots}`` into one command for an existing tool (pdsh, mpirun,
srun) that reaches the other hosts; nothing here opens a connection itself. ``get_cmd`` returns a
:class:`RunnerCommand` instead of running anything, so tests check the exact argv.

pdsh starts ``deepspeed.launcher.launch`` once per node, which then starts the local ranks. The MPI
and SLURM runners let their tool start every rank, through ``deepspeed.launcher.launcher_helper``,
which turns the tool's rank variables into RANK/LOCAL_RANK/WORLD_SIZE.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from deepspeed.launcher.constants import (
    IMPI_LAUNCHER,
    MPICH_LAUNCHER,
    MVAPICH_LAUNCHER,
    MVAPICH_TMP_HOSTFILE,
    OPENMPI_LAUNCHER,
    PDSH_LAUNCHER,
    PDSH_MAX_FAN_OUT,
    SLURM_LAUNCHER,
)
from deepspeed.launcher.numa import available_cores, cores_for_rank, numactl_prefix, parse_core_list

HELPER_MODULE = "deepspeed.launcher.launcher_helper"


def launch_flags(args: argparse.Namespace, runner_pid: int) -> list[str]:
    """Flags the per-node launcher (``deepspeed.launcher.launch``) takes over from the runner's."""
    flags = [f"--{name}" for name in ("no_python", "module", "no_local_rank") if getattr(args, name)]
    if args.save_pid:
        flags.append(f"--save_pid={runner_pid}")
    if args.enable_each_rank_log != "None":
        flags.append(f"--enable_each_rank_log={args.enable_each_rank_log}")
    if args.bind_cores_to_rank:
        flags.append("--bind_cores_to_rank")
    if args.bind_core_list is not None:
        flags.append(f"--bind_core_list={args.bind_core_list}")
    return flags


@dataclass(frozen=True)
class RunnerCommand:
    """What to run on this machine to start the whole job."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    kill_argv: tuple[str, ...] = ()
    """Run when the launch is interrupted, to stop what the tool left on other hosts (pdsh only)."""
    files: Mapping[str, str] = field(default_factory=dict)
    """``{path: content}`` to write before running ``argv``."""


class MultiNodeRunner(ABC):
    """Base of the multi-node runners: holds the arguments, world info and variables to export."""

    def __init__(self, args: argparse.Namespace, world_info_base64: str) -> None:
        self.args = args
        self.world_info_base64 = world_info_base64
        self.user_script: str = args.user_script
        self.user_arguments: list[str] = list(args.user_args)
        self.exports: OrderedDict[str, str] = OrderedDict()

    @property
    @abstractmethod
    def name(self) -> str:
        """The ``--launcher`` value selecting this runner."""

    @abstractmethod
    def backend_exists(self) -> bool:
        """Whether the tool this runner drives is installed here."""

    @abstractmethod
    def get_cmd(self, environment: Mapping[str, str], active_resources: Mapping[str, list[int]]) -> RunnerCommand:
        """The command (and environment) that starts every rank on ``active_resources``."""

    def add_export(self, key: str, var: str) -> None:
        """Set ``key=var`` in every rank's environment."""
        self.exports[key.strip()] = var.strip()

    def validate_args(self, active_resources: Mapping[str, list[int]]) -> None:
        """Reject arguments this runner cannot honour.

        Raises:
            ValueError: naming the runner and the unsupported request.
        """
        if self.args.module and self.args.no_python:
            raise ValueError("--module and --no_python are mutually exclusive")

    def _rank_program(self) -> list[str]:
        """``python -u -m launcher_helper ...``: the per-rank program for tools that start ranks themselves."""
        helper = [sys.executable, "-u", "-m", HELPER_MODULE, "--launcher", self.name]
        helper += ["--module"] if self.args.module else []
        helper += ["--no_python"] if self.args.no_python else []
        return helper + [self.user_script, *self.user_arguments]

    def _require_whole_hosts(self, active_resources: Mapping[str, list[int]], uniform: bool) -> None:
        # The tool numbers local ranks 0..n-1 itself, so a subset of slots (e.g. host:2,3) cannot be honoured.
        for host, slots in active_resources.items():
            if list(slots) != list(range(len(slots))):
                raise ValueError(
                    f"{self.name} launcher cannot select individual slots ({host}:{slots}); select whole hosts"
                )
        counts = {len(slots) for slots in active_resources.values()}
        if uniform and len(counts) > 1:
            raise ValueError(f"{self.name} launcher needs the same number of slots on every host, got {sorted(counts)}")

    def _rendezvous_exports(self, world_size: int) -> OrderedDict[str, str]:
        exports = OrderedDict(self.exports)
        exports.update(MASTER_ADDR=str(self.args.master_addr), MASTER_PORT=str(self.args.master_port))
        exports["WORLD_SIZE"] = str(world_size)
        return exports


def _world_size(active_resources: Mapping[str, list[int]]) -> int:
    return sum(len(slots) for slots in active_resources.values())


def _per_node(active_resources: Mapping[str, list[int]]) -> int:
    return len(next(iter(active_resources.values())))


class PDSHRunner(MultiNodeRunner):
    """pdsh over ssh: runs ``deepspeed.launcher.launch`` on every host (``%n`` becomes the node rank)."""

    name = PDSH_LAUNCHER

    def backend_exists(self) -> bool:
        """True when ``pdsh`` is on PATH."""
        return shutil.which("pdsh") is not None

    def _remote_command(self, runner_pid: int) -> list[str]:
        # pdsh joins its arguments into one line that the remote shell re-parses: quote every word,
        # so values with spaces and the user's arguments arrive unchanged.
        quote = shlex.quote
        words = [f"export {key}={quote(value)};" for key, value in self.exports.items()]
        if self.args.venv_script:
            words.append(f"source {quote(self.args.venv_script)};")
        words.append(f"cd {quote(os.path.abspath('.'))};")
        launch = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={self.world_info_base64}"]
        launch += ["--node_rank=%n", f"--master_addr={self.args.master_addr}", f"--master_port={self.args.master_port}"]
        launch += launch_flags(self.args, runner_pid) + [self.user_script, *self.user_arguments]
        return words + [quote(word) for word in launch]

    def get_cmd(self, environment: Mapping[str, str], active_resources: Mapping[str, list[int]]) -> RunnerCommand:
        """``pdsh -S -f <fan out> -w <hosts> <exports; cd; python -m deepspeed.launcher.launch ...>``."""
        env = dict(environment, PDSH_RCMD_TYPE="ssh")
        if self.args.ssh_port is not None:
            env["PDSH_SSH_ARGS_APPEND"] = f"{env.get('PDSH_SSH_ARGS_APPEND', '')} -p {self.args.ssh_port}".strip()
        pdsh = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", ",".join(active_resources)]
        pdsh += shlex.split(self.args.launcher_args)
        # The world info string is unique to this job, so this pattern stops only its launchers.
        kill = pdsh + ["pkill", "-f", shlex.quote(f"deepspeed.launcher.launch --world_info={self.world_info_base64}")]
        return RunnerCommand(tuple(pdsh + self._remote_command(os.getpid())), env, tuple(kill))


class OpenMPIRunner(MultiNodeRunner):
    """Open MPI's ``mpirun`` over the hostfile itself, so filters and counts cannot apply."""

    name = OPENMPI_LAUNCHER

    def backend_exists(self) -> bool:
        """True when Open MPI's ``ompi_info`` is on PATH."""
        return shutil.which("ompi_info") is not None

    def validate_args(self, active_resources: Mapping[str, list[int]]) -> None:
        """Open MPI reads the hostfile directly: reject --include/--exclude/--num_nodes/--num_gpus."""
        super().validate_args(active_resources)
        if self.args.include or self.args.exclude:
            raise ValueError(f"{self.name} launcher does not support --include/--exclude")
        if self.args.num_nodes != -1 or self.args.num_gpus != -1:
            raise ValueError(f"{self.name} launcher does not support --num_nodes/--num_gpus")

    def get_cmd(self, environment: Mapping[str, str], active_resources: Mapping[str, list[int]]) -> RunnerCommand:
        """``mpirun -n <world> -hostfile <hostfile> --mca ... -x K=V ... python -m launcher_helper ...``."""
        world = _world_size(active_resources)
        cmd = ["mpirun", "-n", str(world), "-hostfile", self.args.hostfile]
        user_mpi_args = shlex.split(self.args.launcher_args)
        if "btl_tcp_if_include" not in user_mpi_args:
            # Upstream's defaults; a user's own interface choice replaces them.
            cmd += ["--mca", "btl", "^openib", "--mca", "btl_tcp_if_include", "eth0"]
        if self.args.ssh_port is not None:
            cmd += ["--mca", "plm_rsh_args", f"-p {self.args.ssh_port}"]
        cmd += user_mpi_args
        for key, value in self._rendezvous_exports(world).items():
            cmd += ["-x", f"{key}={value}"]
        return RunnerCommand(tuple(cmd + self._rank_program()), dict(environment))


class MPICHRunner(MultiNodeRunner):
    """MPICH (Hydra) ``mpirun`` with an explicit host list and ``-ppn``."""

    name = MPICH_LAUNCHER

    def backend_exists(self) -> bool:
        """True when ``mpirun`` is on PATH."""
        return shutil.which("mpirun") is not None

    def validate_args(self, active_resources: Mapping[str, list[int]]) -> None:
        """Hydra starts ``-ppn`` ranks per host: hosts must be whole and equal."""
        super().validate_args(active_resources)
        self._require_whole_hosts(active_resources, uniform=True)

    def _hydra_env_and_hosts(self, active_resources: Mapping[str, list[int]]) -> list[str]:
        """``-genv K V`` for the exports and rendezvous variables, then ``-hosts h1,h2``."""
        exports = self._rendezvous_exports(_world_size(active_resources))
        exports["LOCAL_SIZE"] = str(_per_node(active_resources))
        cmd: list[str] = []
        for key, value in exports.items():
            cmd += ["-genv", key, value]
        return cmd + ["-hosts", ",".join(active_resources)]

    def get_cmd(self, environment: Mapping[str, str], active_resources: Mapping[str, list[int]]) -> RunnerCommand:
        """``mpirun -n <world> -ppn <per node> -genv K V ... -hosts h1,h2 python -m launcher_helper ...``."""
        cmd = ["mpirun", "-n", str(_world_size(active_resources)), "-ppn", str(_per_node(active_resources))]
        cmd += shlex.split(self.args.launcher_args) + self._hydra_env_and_hosts(active_resources)
        return RunnerCommand(tuple(cmd + self._rank_program()), dict(environment))


class IMPIRunner(MPICHRunner):
    """Intel MPI: Hydra syntax, one MPMD segment per rank so each can get its own core binding."""

    name = IMPI_LAUNCHER

    def get_cmd(self, environment: Mapping[str, str], active_resources: Mapping[str, list[int]]) -> RunnerCommand:
        """``mpirun -ppn <n> -genv K V ... -hosts ... -n 1 -env RANK 0 -env LOCAL_RANK 0 [numactl] prog : ...``."""
        per_node = _per_node(active_resources)
        cmd = ["mpirun", "-ppn", str(per_node), *shlex.split(self.args.launcher_args)]
        # Intel MPI's own pinning would fight the launcher's numactl binding.
        cmd += ["-genv", "I_MPI_PIN", "0"]
        cores = None
        if self.args.bind_cores_to_rank:
            cores = parse_core_list(self.args.bind_core_list) if self.args.bind_core_list else available_cores()
            cmd += ["-genv", "OMP_NUM_THREADS", str(len(cores_for_rank(cores, per_node, per_node - 1)))]
        cmd += self._hydra_env_and_hosts(active_resources)
        for rank in range(_world_size(active_resources)):
            local_rank = rank % per_node
            pin = numactl_prefix(cores_for_rank(cores, per_node, local_rank)) if cores else []
            cmd += ([":"] if rank else []) + [
                "-n",
                "1",
                "-env",
                "RANK",
                str(rank),
                "-env",
                "LOCAL_RANK",
                str(local_rank),
            ]
            cmd += pin + self._rank_program()
        return RunnerCommand(tuple(cmd), dict(environment))


class MVAPICHRunner(MultiNodeRunner):
    """MVAPICH2's ``mpirun`` with a host list written to :data:`MVAPICH_TMP_HOSTFILE`."""

    name = MVAPICH_LAUNCHER
    # Settings MVAPICH2-GDR needs for PyTorch jobs (CUDA-aware, no affinity fights with the runtime).
    DEFAULT_EXPORTS = {
        "MV2_SMP_USE_CMA": "0", "MV2_DEBUG_SHOW_BACKTRACE": "1", "MV2_USE_CUDA": "1", "MV2_SUPPORT_DL": "1",
        "MV2_ENABLE_AFFINITY": "0", "MV2_INTER_ALLGATHER_TUNING": "5", "MV2_CUDA_USE_NAIVE": "0",
    }  # fmt: skip

    def __init__(self, args: argparse.Namespace, world_info_base64: str) -> None:
        super().__init__(args, world_info_base64)
        for key, value in self.DEFAULT_EXPORTS.items():
            self.add_export(key, value)

    def backend_exists(self) -> bool:
        """True when MVAPICH's ``mpiname`` is on PATH."""
        return shutil.which("mpiname") is not None

    def validate_args(self, active_resources: Mapping[str, list[int]]) -> None:
        """``-ppn`` ranks per host: hosts must be whole and equal."""
        super().validate_args(active_resources)
        self._require_whole_hosts(active_resources, uniform=True)

    def get_cmd(self, environment: Mapping[str, str], active_resources: Mapping[str, list[int]]) -> RunnerCommand:
        """``mpirun -np <world> -ppn <per node> --hostfile <tmp> -env K V ... python -m launcher_helper ...``."""
        world = _world_size(active_resources)
        cmd = [
            "mpirun",
            "-np",
            str(world),
            "-ppn",
            str(_per_node(active_resources)),
            "--hostfile",
            MVAPICH_TMP_HOSTFILE,
        ]
        cmd += shlex.split(self.args.launcher_args)
        for key, value in self._rendezvous_exports(world).items():
            cmd += ["-env", key, value]
        files = {MVAPICH_TMP_HOSTFILE: "".join(f"{host}\n" for host in active_resources)}
        return RunnerCommand(tuple(cmd + self._rank_program()), dict(environment), files=files)


class SlurmRunner(MultiNodeRunner):
    """``srun`` on exactly the resolved hosts, ``--ntasks-per-node`` ranks each."""

    name = SLURM_LAUNCHER

    def backend_exists(self) -> bool:
        """True when SLURM's ``sinfo`` is on PATH."""
        return shutil.which("sinfo") is not None

    def validate_args(self, active_resources: Mapping[str, list[int]]) -> None:
        """srun places ``--ntasks-per-node`` ranks on each host: hosts must be whole and equal."""
        super().validate_args(active_resources)
        self._require_whole_hosts(active_resources, uniform=True)

    def get_cmd(self, environment: Mapping[str, str], active_resources: Mapping[str, list[int]]) -> RunnerCommand:
        """``srun -n <world> --nodes=<n> --ntasks-per-node=<k> --nodelist=<hosts> --export=ALL,K=V python ...``."""
        world = _world_size(active_resources)
        cmd = ["srun", "-n", str(world), f"--nodes={len(active_resources)}"]
        cmd += [f"--ntasks-per-node={_per_node(active_resources)}", f"--nodelist={','.join(active_resources)}"]
        cmd += shlex.split(self.args.launcher_args)
        if getattr(self.args, "comment", ""):
            cmd += ["--comment", self.args.comment]
        exports = ",".join(f"{key}={value}" for key, value in self._rendezvous_exports(world).items())
        cmd.append(f"--export=ALL,{exports}")
        return RunnerCommand(tuple(cmd + self._rank_program()), dict(environment))


RUNNERS: dict[str, type[MultiNodeRunner]] = {
    runner.name: runner for runner in (PDSHRunner, OpenMPIRunner, MPICHRunner, IMPIRunner, MVAPICHRunner, SlurmRunner)
}
