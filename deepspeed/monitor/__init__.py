"""Training monitors (TensorBoard, Weights & Biases, CSV, Comet); config models live in ``monitor.config``."""
