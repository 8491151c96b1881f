"""Comparison baselines: PyTorch FSDP2 and upstream DeepSpeed."""
