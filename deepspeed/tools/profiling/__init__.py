"""Profiling tools: ``memory_timeline`` turns a CUDA allocator snapshot into a per-category memory timeline."""
