"""torch.distributed-shaped free functions over one process-wide backend object (``cdb``).

This is the implementation behind the public ``deepspeed.comm`` (a façade over this module); the core imports it as
``from deepspeed._core.comm import dist``. Every collective accepts ``async_op`` (returning a handle with
``wait()``) plus the comms-logger keywords ``prof``, ``log_name`` and ``debug``. ``ReduceOp.AVG`` and the flat
``*_tensor`` collectives work on every backend, gloo included (see ``deepspeed/_core/comm/backend.py``).

Fake process groups: ``init_distributed(dist_backend="fake", rank=r, world_size=n)`` builds a simulated group of
``n`` ranks in this one process (torch's ``FakeStore``/``FakeProcessGroup``): ranks, sizes and subgroups behave as
in an ``n``-rank job, collectives return at once without moving data. Use it to exercise sharding layouts and
memory footprints of large worlds on a single device; never for numerics.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from deepspeed._core.comm import backend as _backend
from deepspeed._core.comm.backend import FAKE_BACKEND, ProcessGroup, TorchBackend
from deepspeed._core.comm.comms_logger import CommsLogger
from deepspeed._core.comm.reduce_op import ReduceOp
from deepspeed._core.comm.utils import (
    TORCH_DISTRIBUTED_DEFAULT_PORT,
    default_pg_timeout,
    get_caller_func,
    get_debug_log_name,
    get_default_args,
    get_local_rank_from_launcher,
    get_msg_size_from_args,
)
from deepspeed._foundation import launch_env
from deepspeed._foundation.logging import logger

# The current deepspeed.comm backend; upstream callers read ``deepspeed.comm.comm.cdb`` (forwarded here).
cdb: TorchBackend | None = None

comms_logger = CommsLogger()

_NOT_INIT_MSG = "DeepSpeed backend not set, please initialize it using init_process_group()"
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def _assert_initialized() -> TorchBackend:
    assert cdb is not None and cdb.is_initialized(), _NOT_INIT_MSG
    return cdb


# ---------------------------------------------------------------------- comms logger
def configure(
    deepspeed_config: Any = None,
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: list[str] | None = None,
    verbose: bool | None = None,
    debug: bool | None = None,
) -> None:
    """Configure the comms logger from a ``DeepSpeedConfig`` (its ``comms_config``) and/or explicit values."""
    if deepspeed_config is not None:
        _configure_from_config(deepspeed_config)
    for name, value in (
        ("enabled", enabled),
        ("prof_all", prof_all),
        ("prof_ops", prof_ops),
        ("verbose", verbose),
        ("debug", debug),
    ):
        if value is not None:
            setattr(comms_logger, name, value)


def _configure_from_config(deepspeed_config: Any) -> None:
    # A DeepSpeedConfig (``.comms_config``) or a DeepSpeedCommsConfig. A raw config dict is parsed by the public
    # ``deepspeed.comm.configure`` / ``init_distributed`` before it reaches here: the config models sit above the core.
    comms_config = getattr(deepspeed_config, "comms_config", deepspeed_config)
    if isinstance(comms_config, dict):
        raise TypeError(
            "deepspeed._core.comm.dist.configure takes a DeepSpeedConfig or DeepSpeedCommsConfig; "
            "pass a config dict to deepspeed.comm.configure instead"
        )
    if comms_config is not None and getattr(comms_config, "comms_logger_enabled", True):
        comms_logger.configure(comms_config)


def timed_op(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator recording latency and size of a collective in the comms logger (one ``if`` when disabled)."""

    @functools.wraps(func)
    def log_wrapper(*args: Any, **kwargs: Any) -> Any:
        if not comms_logger.enabled:
            return func(*args, **kwargs)
        return _timed_call(func, args, kwargs)

    return log_wrapper


def _timed_call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    func_args = get_default_args(func)
    func_args.update(kwargs)
    if not comms_logger.should_profile(func_args.get("log_name"), bool(func_args.get("prof"))):
        return func(*args, **kwargs)
    if comms_logger.debug and not func_args.get("debug"):
        func_args["debug"] = get_caller_func(4)
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    accelerator.synchronize()
    start = time.perf_counter()
    result = func(*args, **kwargs)
    # Timing needs the op finished: wait on async handles too (a later wait() returns at once).
    if result is not None and hasattr(result, "wait"):
        result.wait()
    accelerator.synchronize()
    if cdb is not None and cdb.using_mpi:
        cdb.barrier()
    latency_ms = (time.perf_counter() - start) * 1000.0
    record = get_debug_log_name(func_args, comms_logger.debug)
    comms_logger.append(func.__name__, record, latency_ms, get_msg_size_from_args(func, *args, **kwargs))
    return result


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> Any:
    """Log the comms-logger table on rank 0 (all ranks synchronise); optionally return it as a dict."""
    backend = _assert_initialized()
    barrier(log_name="log_summary_barrier")
    result = comms_logger.log_all(
        print_log=backend.get_rank() == 0, show_straggler=show_straggler, return_dict=return_dict
    )
    barrier(log_name="log_summary_barrier")
    return result


def reset_log() -> None:
    """Forget all comms-logger records (e.g. at the start of each epoch)."""
    comms_logger.reset_data()


def has_comm_data() -> bool:
    """True when the comms logger holds at least one record."""
    return comms_logger.has_data()


def get_comm_operation_count() -> int:
    """Number of logged collective calls."""
    return comms_logger.get_total_operations()


def get_logged_comm_ops() -> list[str]:
    """Names of the logged collectives."""
    return comms_logger.get_operation_names()


# ---------------------------------------------------------------------- lifecycle
def is_initialized() -> bool:
    """True once :func:`init_distributed` (or the user) has created the default process group."""
    return cdb is not None and cdb.is_initialized()


def is_available() -> bool:
    """True: this package always provides ``deepspeed.comm``."""
    return True


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Destroy ``group``, or the default group and all subgroups when ``None``."""
    _assert_initialized().destroy_process_group(group=group)


def new_group(ranks: Sequence[int]) -> ProcessGroup:
    """Create a subgroup of the given global ranks (every rank must call it, members or not)."""
    return _assert_initialized().new_group(ranks)


def get_backend(group: ProcessGroup | None = None) -> str:
    """Backend name of ``group`` (``'nccl'``, ``'gloo'``, ``'fake'``...)."""
    return _assert_initialized().get_backend(group)


def get_world_group() -> ProcessGroup:
    """The world process group."""
    return _assert_initialized().get_world_group()


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (default: world). Asserts that the backend is initialised."""
    return _assert_initialized().get_world_size(group)


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: world); -1 when not a member. Asserts initialisation."""
    return _assert_initialized().get_rank(group)


def get_local_rank() -> int:
    """Rank of this process on its node, as exported by the launcher (``LOCAL_RANK``)."""
    _assert_initialized()
    return get_local_rank_from_launcher()


def get_global_rank(group: ProcessGroup | None = None, group_rank: int = 0) -> int:
    """Global rank of member ``group_rank`` of ``group``."""
    return _assert_initialized().get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: ProcessGroup | None = None) -> list[int]:
    """Global ranks of all members of ``group``."""
    return _assert_initialized().get_all_ranks_from_group(group)


def has_all_gather_into_tensor() -> bool:
    """True: ``all_gather_into_tensor`` works on every backend."""
    return _assert_initialized().has_all_gather_into_tensor()


def has_reduce_scatter_tensor() -> bool:
    """True: ``reduce_scatter_tensor`` works on every backend."""
    return _assert_initialized().has_reduce_scatter_tensor()


def has_coalescing_manager() -> bool:
    """Whether torch provides a coalescing manager for batching collectives."""
    return _assert_initialized().has_coalescing_manager


def has_all_reduce_coalesced() -> bool:
    """True: ``all_reduce_coalesced`` is available."""
    return _assert_initialized().has_all_reduce_coalesced


def initialize_mesh_device(mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...]) -> Any:
    """Build a torch ``DeviceMesh`` of ``mesh_shape`` with named dimensions."""
    return _assert_initialized().init_device_mesh(mesh_shape, mesh_dim_names)


# ---------------------------------------------------------------------- collectives
@timed_op
def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "broadcast",
    debug: str | None = None,
) -> Any:
    """Copy ``tensor`` from global rank ``src`` to all ranks of ``group``."""
    return _assert_initialized().broadcast(tensor=tensor, src=src, group=group, async_op=async_op)


@timed_op
def broadcast_object_list(
    object_list: list[Any], src: int, group: ProcessGroup | None = None, device: Any = None
) -> None:
    """Broadcast picklable objects in place from global rank ``src``."""
    return _assert_initialized().broadcast_object_list(object_list=object_list, src=src, group=group, device=device)


@timed_op
def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_gather",
    debug: str | None = None,
) -> Any:
    """Gather every rank's ``tensor`` into ``tensor_list``."""
    return _assert_initialized().all_gather(tensor_list=tensor_list, tensor=tensor, group=group, async_op=async_op)


@timed_op
def all_gather_object(
    object_list: list[Any],
    obj: Any,
    group: ProcessGroup | None = None,
    prof: bool = False,
    log_name: str = "all_gather_object",
    debug: str | None = None,
) -> None:
    """Gather one picklable object per rank into ``object_list``."""
    return _assert_initialized().all_gather_object(object_list=object_list, obj=obj, group=group)


@timed_op
def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_gather_into_tensor",
    debug: str | None = None,
) -> Any:
    """Concatenate every rank's ``tensor`` (in rank order) into ``output_tensor``."""
    return _assert_initialized().all_gather_into_tensor(
        output_tensor=output_tensor, input_tensor=tensor, group=group, async_op=async_op
    )


def allgather_fn(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    debug: str | None = None,
) -> Any:
    """Flat all-gather on any backend (kept for callers written against older torch versions)."""
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op, debug=debug)


def all_gather_coalesced(
    output_tensors: Sequence[torch.Tensor],
    input_tensors: Sequence[torch.Tensor],
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """Flat all-gather of several (output, input) pairs under one handle."""
    return _assert_initialized().all_gather_coalesced(output_tensors, input_tensors, group=group, async_op=async_op)


@timed_op
def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce_scatter_tensor",
    debug: str | None = None,
) -> Any:
    """Reduce ``tensor`` across ranks and leave this rank's equal-sized slice in ``output_tensor``."""
    return _assert_initialized().reduce_scatter_tensor(
        output_tensor=output_tensor, input_tensor=tensor, op=op, group=group, async_op=async_op
    )


def reduce_scatter_fn(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    prof: bool = False,
    debug: str | None = None,
) -> Any:
    """Flat reduce-scatter on any backend (kept for callers written against older torch versions)."""
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op, prof=prof, debug=debug)


@timed_op
def reduce_scatter(
    output: torch.Tensor,
    input_list: Sequence[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce_scatter",
    debug: str | None = None,
) -> Any:
    """Reduce entry i of every rank's ``input_list`` into rank i's ``output``."""
    return _assert_initialized().reduce_scatter(
        output=output, input_list=input_list, op=op, group=group, async_op=async_op
    )


@timed_op
def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_to_all_single",
    debug: str | None = None,
) -> Any:
    """Scatter slices of ``tensor`` to all ranks and gather theirs into ``output``."""
    return _assert_initialized().all_to_all_single(
        output=output,
        input=tensor,
        output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes,
        group=group,
        async_op=async_op,
    )


@timed_op
def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """Send ``input_tensor_list[i]`` to rank i; receive rank i's into ``output_tensor_list[i]``."""
    return _assert_initialized().all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


@timed_op
def send(
    tensor: torch.Tensor,
    dst: int,
    group: ProcessGroup | None = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "send",
    debug: str | None = None,
) -> None:
    """Blocking send to global rank ``dst``."""
    return _assert_initialized().send(tensor=tensor, dst=dst, group=group, tag=tag)


@timed_op
def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: ProcessGroup | None = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "recv",
    debug: str | None = None,
) -> int:
    """Blocking receive into ``tensor``; returns the sender's rank."""
    return _assert_initialized().recv(tensor=tensor, src=src, group=group, tag=tag)


@timed_op
def isend(
    tensor: torch.Tensor,
    dst: int,
    group: ProcessGroup | None = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "isend",
    debug: str | None = None,
) -> Any:
    """Non-blocking send; returns a handle with ``wait()``."""
    return _assert_initialized().isend(tensor=tensor, dst=dst, group=group, tag=tag)


@timed_op
def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: ProcessGroup | None = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "irecv",
    debug: str | None = None,
) -> Any:
    """Non-blocking receive; returns a handle with ``wait()``."""
    return _assert_initialized().irecv(tensor=tensor, src=src, group=group, tag=tag)


@timed_op
def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "gather",
    debug: str | None = None,
) -> Any:
    """Gather every rank's ``tensor`` into ``gather_list`` on global rank ``dst``."""
    return _assert_initialized().gather(tensor=tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


@timed_op
def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "scatter",
    debug: str | None = None,
) -> Any:
    """Send ``scatter_list[i]`` from global rank ``src`` into rank i's ``tensor``."""
    return _assert_initialized().scatter(
        tensor=tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op
    )


@timed_op
def barrier(
    group: ProcessGroup | None = None,
    async_op: bool = False,
    device_ids: list[int] | None = None,
    prof: bool = False,
    log_name: str = "barrier",
    debug: str | None = None,
) -> Any:
    """Block until all ranks of ``group`` arrive."""
    return _assert_initialized().barrier(group=group, async_op=async_op, device_ids=device_ids)


@timed_op
def monitored_barrier(
    group: ProcessGroup | None = None,
    timeout: timedelta | None = None,
    wait_all_ranks: bool = False,
    prof: bool = False,
    log_name: str = "monitored_barrier",
    debug: str | None = None,
) -> Any:
    """Barrier that reports which ranks failed to arrive within ``timeout`` (gloo)."""
    return _assert_initialized().monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


@timed_op
def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Any = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce",
    debug: str | None = None,
) -> Any:
    """Reduce ``tensor`` onto global rank ``dst``."""
    return _assert_initialized().reduce(tensor=tensor, dst=dst, op=op, group=group, async_op=async_op)


@timed_op
def all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_reduce",
    debug: str | None = None,
) -> Any:
    """Reduce ``tensor`` in place across all ranks of ``group``."""
    return _assert_initialized().all_reduce(tensor, op, group, async_op)


@timed_op
def inference_all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_reduce",
    debug: str | None = None,
) -> None:
    """Blocking all-reduce used by inference paths."""
    return _assert_initialized().inference_all_reduce(tensor, op, group)


@timed_op
def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_reduce",
    debug: str | None = None,
) -> Any:
    """All-reduce a list of tensors with one collective per dtype."""
    return _assert_initialized().all_reduce_coalesced(tensors, op, group, async_op)


# ---------------------------------------------------------------------- initialisation
def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int | str = TORCH_DISTRIBUTED_DEFAULT_PORT,
    verbose: bool = True,
    timeout: timedelta = default_pg_timeout,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Create (or adopt) the default process group and make it the ``deepspeed.comm`` backend.

    Args:
        dist_backend: torch backend name; ``None`` uses the accelerator's (``nccl`` on CUDA, ``gloo`` on CPU).
            ``"fake"`` builds a simulated group (see the module docstring).
        auto_mpi_discovery: when launcher variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) are
            missing, derive them from MPI (``OMPI_COMM_WORLD_*``/``PMI_*``) or default to a 1-process job.
        distributed_port: MASTER_PORT used when the environment does not give one (an int or a numeric string).
        verbose: log what was discovered.
        timeout: collective timeout (default: ``DEEPSPEED_TIMEOUT`` minutes, 10 when unset).
        init_method: torch rendezvous URL; ``None`` means ``env://``.
        dist_init_required: ``False`` asserts a group already exists; ``None`` initialises only when needed.
        config: a ``DeepSpeedConfig`` whose ``comms_config`` configures the comms logger.
        rank, world_size: explicit values for URL or fake rendezvous (else read from the environment).
    """
    global cdb
    configure(deepspeed_config=config)
    if dist_init_required is None:
        dist_init_required = not is_initialized()
    if cdb is None and _backend.torch_dist_initialized():
        # The user created the torch process group; wrap it rather than initialising again.
        cdb = TorchBackend(dist_backend, timeout, init_method)
    elif dist_init_required is False:
        assert is_initialized(), (
            "Distributed backend is not initialized. Please set dist_init_required to True "
            "or initialize before calling deepspeed.initialize()"
        )
    elif not is_initialized():
        _initialize_backend(
            dist_backend, auto_mpi_discovery, int(distributed_port), verbose, timeout, init_method, rank, world_size
        )
    elif verbose and _assert_initialized().get_rank() == 0:
        logger.info("Distributed backend already initialized")
    backend = _assert_initialized()
    comms_logger.rank, comms_logger.world_size = backend.get_rank(), backend.get_world_size()


def _initialize_backend(
    dist_backend: str | None,
    auto_mpi_discovery: bool,
    distributed_port: int,
    verbose: bool,
    timeout: timedelta,
    init_method: str | None,
    rank: int,
    world_size: int,
) -> None:
    global cdb
    assert isinstance(timeout, timedelta), f"timeout must be a datetime.timedelta, got {type(timeout).__name__}"
    uses_env = init_method in (None, "env://") and dist_backend != FAKE_BACKEND
    if uses_env and auto_mpi_discovery and not all(v in os.environ for v in _LAUNCHER_ENV):
        _fill_launcher_env(distributed_port, verbose)
    if dist_backend is None:
        from deepspeed.accelerator import get_accelerator

        dist_backend = get_accelerator().communication_backend_name()
    if verbose and int(os.environ.get("RANK", "0")) == 0:
        logger.info(f"Initializing TorchBackend in DeepSpeed with backend {dist_backend}")
    cdb = TorchBackend(dist_backend, timeout, init_method, rank, world_size)


def _fill_launcher_env(distributed_port: int, verbose: bool) -> None:
    """Complete the torch rendezvous variables from whichever launcher started this process.

    torch's own names win, then MPI (Open MPI, PMI, MVAPICH2 variables, or mpi4py), then SLURM's ``srun`` task
    variables; with none of them present this is a single-process job. A launcher whose variables are only partly
    present raises :class:`~deepspeed._foundation.launch_env.LaunchEnvError` naming the missing ones.
    """
    found = launch_env.detect(os.environ)
    under_mpi = found.launcher in launch_env.MPI_FLAVOURS if found is not None else _mpi4py_world() is not None
    if under_mpi:
        mpi_discovery(distributed_port=distributed_port, verbose=verbose)
        return
    if found is None:
        if verbose:
            logger.info("No launcher or MPI environment found; initialising a single-process group")
        found = launch_env.detect({"RANK": "0", "WORLD_SIZE": "1"})
        assert found is not None  # RANK and WORLD_SIZE are torch's variables, so detection finds torch's launcher
    if found.master_addr is None:
        raise launch_env.LaunchEnvError(
            f"{found.launcher.name}: rank {found.rank} of {found.world_size} does not know where rank 0 runs; "
            "export MASTER_ADDR=<address of rank 0>"
        )
    for name, value in found.torch_env().items():
        if found.launcher is launch_env.TORCH:
            os.environ.setdefault(name, value)
        else:
            os.environ[name] = value
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    if verbose and found.launcher is not launch_env.TORCH:
        logger.info(
            f"Discovered {found.launcher.name} settings: rank={found.rank}, local_rank={found.local_rank}, "
            f"world_size={found.world_size}, master_addr={found.master_addr}, "
            f"master_port={os.environ['MASTER_PORT']}"
        )


def _mpi4py_world() -> dict[str, Any] | None:
    """Rank layout from mpi4py when it is installed and the job has more than one rank."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    if comm.Get_size() <= 1:
        return None
    import socket

    host = MPI.Get_processor_name()
    hosts = comm.allgather(host)
    master = comm.bcast(socket.gethostbyname(socket.gethostname()) if comm.Get_rank() == 0 else None, root=0)
    rank = comm.Get_rank()
    return {
        "rank": rank,
        "world_size": comm.Get_size(),
        "local_rank": hosts[:rank].count(host),
        "local_size": hosts.count(host),
        "master_addr": master,
    }


def _mpi_layout() -> dict[str, Any] | None:
    """Rank layout from the MPI launcher's variables, else from mpi4py; ``None`` outside MPI."""
    found = launch_env.detect(os.environ, tool_first=True)
    if found is None or found.launcher not in launch_env.MPI_FLAVOURS:
        return _mpi4py_world()
    layout = {
        "rank": found.rank,
        "world_size": found.world_size,
        "local_rank": found.local_rank,
        "master_addr": found.master_addr,
    }
    if layout["master_addr"] is None:
        layout["master_addr"] = (_mpi4py_world() or {}).get("master_addr")
    return layout


def mpi_discovery(distributed_port: int | str = TORCH_DISTRIBUTED_DEFAULT_PORT, verbose: bool = True) -> None:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from an MPI launch.

    Reads Open MPI (``OMPI_COMM_WORLD_*``) or PMI-style variables, so mpi4py is not required. MASTER_ADDR defaults to
    127.0.0.1 on a single node; multi-node jobs need MASTER_ADDR exported (or mpi4py installed to discover it).
    """
    layout = _mpi_layout()
    if layout is None:
        raise RuntimeError(
            "mpi_discovery found no MPI environment (OMPI_COMM_WORLD_*, PMI_* or MV2_COMM_WORLD_* "
            "variables); launch with mpirun, the deepspeed launcher or torchrun, or export RANK/"
            "WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT"
        )
    master = layout["master_addr"]
    if master is None:
        raise RuntimeError(
            "multi-node MPI launch without MASTER_ADDR: export MASTER_ADDR=<address of rank 0> "
            "(or install mpi4py so it can be discovered)"
        )
    os.environ["RANK"] = str(layout["rank"])
    os.environ["WORLD_SIZE"] = str(layout["world_size"])
    os.environ["LOCAL_RANK"] = str(layout["local_rank"])
    os.environ["MASTER_ADDR"] = master
    os.environ.setdefault("MASTER_PORT", str(int(distributed_port)))
    if verbose:
        logger.info(
            f"Discovered MPI settings of world_rank={layout['rank']}, local_rank={layout['local_rank']}, "
            f"world_size={layout['world_size']}, master_addr={master}, "
            f"master_port={os.environ['MASTER_PORT']}"
        )
    if is_initialized():
        backend = _assert_initialized()
        assert backend.get_rank() == layout["rank"], f"MPI rank {layout['rank']} != torch rank {backend.get_rank()}"
        assert backend.get_world_size() == layout["world_size"], "MPI world size does not match torch world size"
