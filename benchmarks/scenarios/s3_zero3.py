"""S3, user report 3 (ZeRO-3 release timing): SLOT, not measured yet.

Stage 3 of deepspeed-lean is still being written, so this worker only records that fact (status "skipped") when
``deepspeed.initialize`` refuses stage 3; run_all includes it only with ``--with-s3``. When stage 3 lands, the
measurement to add here (the lead's S3 run) is:
* model: a Qwen2-shaped decoder from a config with random weights (3B, and the 7.6B shape), seq 512,
  activation checkpointing, micro-batch 1, bf16; ``offload_optimizer`` cpu on and off; world sizes 1 and 8 (fake);
* peak allocated/reserved over a step and steady-state allocated (compare with the ZeRO-3 floors in
  memory_targets.md and with S1's ZeRO-2 peak of the same model);
* gathered units alive at each module boundary (from the engine's parameter manager hooks) and from a
  ``torch.cuda.memory._record_memory_history`` trace: max alive ≤ current + prefetch window; deferred frees;
* step time, ours lean vs ``lean_stream_ordered_release: false`` vs upstream vs FSDP2.
The generic pieces (trainer adapters, config, memory probes) are in ``_harness.py``; S1's protocol applies.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import worker_main
from s1_grad_accum import run as s1_run


def run(spec: dict) -> dict:
    """Run S1's protocol at stage 3; a build without stage 3 yields a 'skipped' record instead of a number."""
    try:
        return s1_run(dict(spec, stage=3))
    except NotImplementedError as exc:
        return {"skip_reason": f"stage 3 not available in this build: {exc}"}


if __name__ == "__main__":
    worker_main("s3_zero3", run)
