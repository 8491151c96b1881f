"""Package logger and rank-aware logging helpers.

``deepspeed.utils.logger`` is a plain :class:`logging.Logger`; integrations call
``setLevel`` on it directly, so it must stay a standard logger.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable

LOG_FORMAT = "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"

log_levels = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def _create_logger(name: str = "DeepSpeed", level: int = logging.INFO) -> logging.Logger:
    lg = logging.getLogger(name)
    lg.setLevel(level)
    lg.propagate = False
    if not lg.handlers:
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        lg.addHandler(handler)
    return lg


logger = _create_logger(level=log_levels.get(os.environ.get("DS_LOG_LEVEL", "info").lower(), logging.INFO))


def _current_rank() -> int:
    # Read from the environment so logging never needs an initialised process group
    # (and so this module stays free of torch.distributed).
    return int(os.environ.get("RANK", "0"))


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the given global ranks (all ranks when ``ranks`` holds -1).

    Args:
        message: text to log.
        ranks: ranks that should log; ``None`` means rank 0 only, ``[-1]`` means every rank.
        level: a :mod:`logging` level.
    """
    wanted = list(ranks) if ranks is not None else [0]
    rank = _current_rank()
    if -1 in wanted or rank in wanted:
        logger.log(level, f"[Rank {rank}] {message}")


def print_dist(message: str, ranks: Iterable[int] | None = None) -> None:
    """Write ``message`` to standard output on the given global ranks (all when ``None`` or holding -1)."""
    rank = _current_rank()
    if ranks is None or -1 in ranks or rank in ranks:
        sys.stdout.write(f"[Rank {rank}] {message}\n")
        sys.stdout.flush()


def print_json_dist(message: dict, ranks: Iterable[int] | None = None, path: str | None = None) -> None:
    """Write ``message`` as JSON to ``path`` on the selected ranks (upstream helper name)."""
    import json

    if path is None:
        raise ValueError("print_json_dist: path is required (the file the JSON is written to)")
    wanted = list(ranks) if ranks is not None else [0]
    if -1 in wanted or _current_rank() in wanted:
        message = dict(message, rank=_current_rank())
        with open(path, "w") as fd:
            json.dump(message, fd)
            os.fsync(fd.fileno())


def should_log_le(max_log_level_str: str) -> bool:
    """True when the logger's level is at or below ``max_log_level_str``."""
    if max_log_level_str.lower() not in log_levels:
        raise ValueError(f"{max_log_level_str} is not a valid log level; valid: {sorted(log_levels)}")
    return logger.getEffectiveLevel() <= log_levels[max_log_level_str.lower()]
