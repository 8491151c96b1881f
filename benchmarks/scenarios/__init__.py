"""Benchmark scenarios; each file is a worker run in its own process by run_all.py."""
