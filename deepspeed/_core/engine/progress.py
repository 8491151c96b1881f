"""One readable progress line every ``steps_per_print`` optimizer steps, on rank 0."""

from __future__ import annotations

import math
import time
from typing import Any

from deepspeed._foundation.logging import log_dist
from deepspeed.accelerator import get_accelerator

_GIB = float(1 << 30)


class ProgressReporter:
    """Formats step, loss scale, lr, grad norm, samples/s and memory.

    Args:
        steps_per_print: report period in optimizer steps; ``None``, ``0`` or ``inf`` disables it.
        train_batch_size: global samples per optimizer step (for throughput).
    """

    def __init__(self, steps_per_print: float | None, train_batch_size: int) -> None:
        self.period = steps_per_print
        self.train_batch_size = train_batch_size
        self._last_time = time.perf_counter()
        self._last_step = 0

    def enabled(self) -> bool:
        """True when periodic reports are on."""
        return self.period is not None and math.isfinite(self.period) and self.period > 0

    def maybe_report(self, global_steps: int, loss_scale: float, lrs: list[float], grad_norm: Any) -> str | None:
        """Log (and return) the progress line when ``global_steps`` hits the period."""
        if self.period is None or not self.enabled() or global_steps % int(self.period) != 0:
            return None
        now = time.perf_counter()
        steps = max(global_steps - self._last_step, 1)
        samples_per_sec = steps * self.train_batch_size / max(now - self._last_time, 1e-9)
        self._last_time, self._last_step = now, global_steps
        acc = get_accelerator()
        norm = "n/a" if grad_norm is None else f"{float(grad_norm):.4g}"
        line = (
            f"step={global_steps} loss_scale={loss_scale:g} lr={','.join(f'{lr:.4g}' for lr in lrs)} "
            f"grad_norm={norm} samples/s={samples_per_sec:.2f} "
            f"mem_alloc={acc.memory_allocated() / _GIB:.2f}GiB mem_reserved={acc.memory_reserved() / _GIB:.2f}GiB "
            f"mem_peak={acc.max_memory_allocated() / _GIB:.2f}GiB"
        )
        log_dist(line, ranks=[0])
        return line
