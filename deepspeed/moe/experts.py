"""Local experts container (upstream path ``deepspeed.moe.experts``)."""

from deepspeed._core.moe.layer import Experts

__all__ = ["Experts"]
