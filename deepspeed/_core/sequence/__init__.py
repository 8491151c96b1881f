"""Long sequences: tiled compute along the sequence and sequence parallelism."""
