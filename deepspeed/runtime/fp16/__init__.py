"""fp16 support at upstream's package path (``deepspeed.runtime.fp16.loss_scaler`` holds the scalers)."""
