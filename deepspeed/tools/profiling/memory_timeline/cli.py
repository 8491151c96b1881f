"""The command line: summarise (and optionally chart) a pickled allocator snapshot, printing the summary as JSON.

``python -m deepspeed.tools.profiling.memory_timeline SNAPSHOT [--png out.png] [--json out.json] [--unit-bytes N]
[--device D]``; where another DeepSpeed (or none) is importable, run the package directory itself:
``python <repo>/deepspeed/tools/profiling/memory_timeline SNAPSHOT ...`` (it needs neither torch nor DeepSpeed).
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from .classify import recording_meta
from .plot import plot_timeline
from .timeline import build_timeline, summarize


def _load(path: str) -> dict[str, Any]:
    with open(path, "rb") as fd:
        return pickle.load(fd)


def _default_device(snapshot: Mapping[str, Any]) -> int:
    recorded = recording_meta(snapshot).get("device")
    if isinstance(recorded, int):
        return recorded
    traces = snapshot.get("device_traces") or [[]]
    return max(range(len(traces)), key=lambda d: len(traces[d]))


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: summarise (and optionally plot) a pickled snapshot; prints the summary as JSON."""
    parser = argparse.ArgumentParser(
        prog="memory_timeline", description="Per-category memory timeline of a CUDA allocator snapshot."
    )
    parser.add_argument("snapshot", help="pickle written by torch.cuda.memory._dump_snapshot or memory_timeline")
    parser.add_argument("--png", help="write the stacked-area chart here (needs matplotlib)")
    parser.add_argument("--json", help="write the summary here as well")
    parser.add_argument("--unit-bytes", type=float, default=None, help="bytes of one gathered layer")
    parser.add_argument("--device", type=int, default=None, help="device index (default: the recorded one)")
    args = parser.parse_args(argv)
    snapshot = _load(args.snapshot)
    device = _default_device(snapshot) if args.device is None else args.device
    summary = summarize(snapshot, device, args.unit_bytes)
    text = json.dumps(summary, indent=2)
    if args.json:
        with open(args.json, "w") as fd:
            fd.write(text + "\n")
    if args.png:
        plot_timeline(build_timeline(snapshot, device), args.png, title=args.snapshot)
    sys.stdout.write(text + "\n")
    return 0
