"""Pipeline parallelism internals: topology and grid, partitioning, the pipeline module, schedules, checkpoints."""
