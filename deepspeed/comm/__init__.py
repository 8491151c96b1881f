"""``deepspeed.comm``: import as ``from deepspeed import comm as dist``; mirrors torch.distributed's free functions."""
from deepspeed.comm.comm import (  # noqa: F401
    all_gather, all_gather_coalesced, all_gather_into_tensor, all_gather_object, all_reduce, all_reduce_coalesced,
    all_to_all, all_to_all_single, allgather_fn, barrier, broadcast, broadcast_object_list, configure,
    destroy_process_group, gather, get_all_ranks_from_group, get_backend, get_comm_operation_count, get_global_rank,
    get_local_rank, get_logged_comm_ops, get_rank, get_world_group, get_world_size, has_all_gather_into_tensor,
    has_all_reduce_coalesced, has_coalescing_manager, has_comm_data, has_reduce_scatter_tensor, inference_all_reduce,
    init_distributed, initialize_mesh_device, irecv, is_available, is_initialized, isend, log_summary,
    monitored_barrier, mpi_discovery, new_group, recv, reduce, reduce_scatter, reduce_scatter_fn,
    reduce_scatter_tensor, reset_log, scatter, send, timed_op)
from deepspeed.comm.backend import ProcessGroup  # noqa: F401
from deepspeed.comm.reduce_op import ReduceOp  # noqa: F401
from deepspeed.comm.utils import (  # noqa: F401
    TORCH_DISTRIBUTED_DEFAULT_PORT, default_pg_timeout, get_local_rank_from_launcher, get_world_rank_from_launcher,
    get_world_size_from_launcher)
