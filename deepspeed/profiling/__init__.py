"""Profilers with upstream's import paths (``deepspeed.profiling.flops_profiler``)."""
