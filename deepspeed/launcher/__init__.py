"""The ``deepspeed`` command-line launcher (``runner``) and its per-node spawner (``launch``).

Nothing is imported eagerly: ``deepspeed.launcher.runner`` must start fast and never import torch
unless it needs to ask the accelerator how many devices this machine has.
"""
