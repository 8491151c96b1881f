"""Observing a run: monitors (TensorBoard, W&B, CSV, Comet), step timers and the FLOPs profiler."""
