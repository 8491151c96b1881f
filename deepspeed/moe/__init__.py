"""Mixture-of-experts layers (``deepspeed.moe``): ``layer.MoE``, ``sharded_moe``, ``experts``, ``utils``."""
