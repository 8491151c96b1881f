"""``deepspeed.runtime.sequence_parallel``: long-sequence training for Hugging Face models."""
