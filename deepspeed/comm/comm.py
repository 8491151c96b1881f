"""``deepspeed.comm.comm``: upstream's module of the communication free functions.

The functions are implemented in deepspeed/_core/comm/dist.py and re-exported here under the same names. Module
state that callers read (``cdb``, the current backend) is forwarded, so it is never a stale copy. ``configure`` and
``init_distributed`` also accept a raw config dict and parse its ``comms_logger`` block first.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from deepspeed._core.comm import dist as _dist
from deepspeed._core.comm.dist import (  # noqa: F401
    ProcessGroup,
    ReduceOp,
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    allgather_fn,
    barrier,
    broadcast,
    broadcast_object_list,
    comms_logger,
    destroy_process_group,
    gather,
    get_all_ranks_from_group,
    get_backend,
    get_comm_operation_count,
    get_global_rank,
    get_local_rank,
    get_logged_comm_ops,
    get_rank,
    get_world_group,
    get_world_size,
    has_all_gather_into_tensor,
    has_all_reduce_coalesced,
    has_coalescing_manager,
    has_comm_data,
    has_reduce_scatter_tensor,
    inference_all_reduce,
    irecv,
    is_available,
    is_initialized,
    isend,
    log_summary,
    monitored_barrier,
    mpi_discovery,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_fn,
    reduce_scatter_tensor,
    reset_log,
    scatter,
    send,
    timed_op,
)


def _parsed(config: Any) -> Any:
    """``config`` with a raw dict replaced by its validated ``comms_logger`` holder."""
    if isinstance(config, dict):
        from deepspeed.comm.config import DeepSpeedCommsConfig

        return DeepSpeedCommsConfig(config)
    return config


@functools.wraps(_dist.configure)
def configure(*args: Any, **kwargs: Any) -> None:
    bound = inspect.signature(_dist.configure).bind(*args, **kwargs)
    bound.arguments["deepspeed_config"] = _parsed(bound.arguments.get("deepspeed_config"))
    _dist.configure(*bound.args, **bound.kwargs)


@functools.wraps(_dist.init_distributed)
def init_distributed(*args: Any, **kwargs: Any) -> None:
    bound = inspect.signature(_dist.init_distributed).bind(*args, **kwargs)
    bound.arguments["config"] = _parsed(bound.arguments.get("config"))
    _dist.init_distributed(*bound.args, **bound.kwargs)


def __getattr__(name: str) -> Any:
    # Rebound module state (``cdb``) and private helpers are read from the implementation at access time.
    return getattr(_dist, name)
