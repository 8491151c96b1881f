"""Checks of the monitor and profiler outputs, run on every rank before the engine's first collective.

A monitor whose directory cannot be written, or whose library is not installed, would otherwise fail on rank 0 only,
after the other ranks entered a collective, and hang the job. The checks only look: they create nothing.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from deepspeed._core.config.base import DeepSpeedConfigError
from deepspeed._core.observe.monitors import PACKAGES, monitor_dir, unwritable_reason


def _missing_package(block: str) -> str | None:
    package = PACKAGES[block]
    if package is None or importlib.util.find_spec(package) is not None:
        return None
    return (
        f"{block}.enabled=true needs the '{package}' package, which is not installed; install it with "
        f"`pip install {package.replace('_', '-')}` or set {block}.enabled to false"
    )


def check_outputs(plan: Any) -> None:
    """Raise ``DeepSpeedConfigError`` naming the key when an enabled monitor or the profiler cannot write.

    Args:
        plan: the run plan (its ``tensorboard``, ``csv_monitor``, ``wandb``, ``comet`` and ``flops_profiler``).
    """
    problems = []
    for block in ("tensorboard", "csv_monitor", "wandb", "comet"):
        policy = getattr(plan, block)
        if not policy.enabled:
            continue
        missing = _missing_package(block)
        if missing is not None:
            problems.append(missing)
        if block in ("tensorboard", "csv_monitor"):
            directory = monitor_dir(policy.output_path, policy.job_name)
            reason = unwritable_reason(directory)
            if reason is not None:
                problems.append(
                    f"{block}.output_path={policy.output_path!r} (job_name={policy.job_name!r}): cannot write "
                    f"{directory!r}: {reason}; give a directory this process can create files in"
                )
    profiler = plan.flops_profiler
    if profiler.enabled and profiler.output_file:
        parent = os.path.dirname(os.path.abspath(profiler.output_file))
        reason = unwritable_reason(parent)
        if reason is None and os.path.isdir(profiler.output_file):
            reason = "it is a directory"
        if reason is not None:
            problems.append(
                f"flops_profiler.output_file={profiler.output_file!r} cannot be written: {reason}; give a file "
                "path in a writable directory, or leave it unset to print to standard output"
            )
    if problems:
        raise DeepSpeedConfigError("; ".join(problems))
