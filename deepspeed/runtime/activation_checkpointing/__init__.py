"""Activation checkpointing (``deepspeed.checkpointing``); the config model lives in ``.config``."""
