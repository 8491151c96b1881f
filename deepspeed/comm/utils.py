"""``deepspeed.comm.utils``: launcher-environment and comms-logger helpers (implemented in
deepspeed/_core/comm/utils.py)."""

from __future__ import annotations

from deepspeed._core.comm.utils import (  # noqa: F401
    TORCH_DISTRIBUTED_DEFAULT_PORT,
    default_pg_timeout,
    get_caller_func,
    get_debug_log_name,
    get_default_args,
    get_local_rank_from_launcher,
    get_msg_size_from_args,
    get_world_rank_from_launcher,
    get_world_size_from_launcher,
)
