"""``deepspeed.sequence``: the sequence-parallel exchange under upstream's import path."""
