"""``deepspeed.utils.logging``: upstream's path to the package logger (implemented in deepspeed/_foundation/logging.py).

``deepspeed.utils.logger`` is a plain :class:`logging.Logger`; integrations call ``setLevel`` on it directly.
"""

from __future__ import annotations

from deepspeed._foundation.logging import (  # noqa: F401
    LOG_FORMAT,
    log_dist,
    log_levels,
    logger,
    print_dist,
    print_json_dist,
    should_log_le,
)
