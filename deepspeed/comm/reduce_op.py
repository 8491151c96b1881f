"""``deepspeed.comm.reduce_op``: upstream's home of ``ReduceOp`` (implemented in deepspeed/_core/comm/reduce_op.py)."""

from __future__ import annotations

from deepspeed._core.comm.reduce_op import ReduceOp  # noqa: F401
