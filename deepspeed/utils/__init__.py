"""Utility names that scripts and integrations import from ``deepspeed.utils``."""
from deepspeed.utils import groups
from deepspeed.utils.logging import log_dist, logger

__all__ = ["logger", "log_dist", "groups"]
