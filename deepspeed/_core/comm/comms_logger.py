"""Comms logger: per-collective latency, message size and bandwidth, keyed by operation and size.

Configured by the ``comms_logger`` config block (``enabled``, ``verbose``, ``prof_all``, ``debug``, ``prof_ops``)
or by ``deepspeed.comm.configure(...)``. Bandwidth follows the usual convention: ``algbw`` is bytes over time;
``busbw`` rescales it by the fraction of data each rank actually sends for that collective.
"""

from __future__ import annotations

import datetime
import math
from collections import defaultdict
from typing import Any

from deepspeed._foundation.logging import logger

# Fraction of the message each rank puts on the wire, per collective family, as a function of world size n.
_BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "inference_all_reduce": lambda n: 2 * (n - 1) / n,
    "all_reduce_coalesced": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "all_gather_coalesced": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}


def calc_bw_log(comm_op: str, size: int, duration: float, world_size: int = 1) -> tuple[float, float]:
    """(algbw, busbw) in Gbit/s for ``size`` bytes moved by ``comm_op`` in ``duration`` milliseconds."""
    if duration <= 0:
        return 0.0, 0.0
    algbw = size * 8 / (duration / 1000.0) / 1e9
    factor = _BUS_FACTORS.get(comm_op, lambda n: 1.0)(max(world_size, 1))
    return algbw, algbw * factor


def convert_size(size_bytes: int) -> str:
    """Human-readable byte count (``'1.5 MB'``)."""
    if size_bytes <= 0:
        return "0B"
    units = ("B", "KB", "MB", "GB", "TB", "PB")
    i = min(int(math.floor(math.log(size_bytes, 1024))), len(units) - 1)
    return f"{round(size_bytes / 1024**i, 2)} {units[i]}"


class CommsLogger:
    """Accumulates timing records of collectives; ``deepspeed.comm.log_summary`` prints them."""

    def __init__(self) -> None:
        self.comms_dict: dict[str, dict[int, list[Any]]] = {}
        self.verbose = False
        self.debug = False
        self.prof_ops: list[str] = []
        self.prof_all = True
        self.enabled = False
        self.world_size = 1
        self.rank = 0

    def configure(self, comms_config: Any) -> None:
        """Copy settings from a ``DeepSpeedCommsConfig``-like object (``.comms_logger`` holds the fields)."""
        block = getattr(comms_config, "comms_logger", comms_config)
        self.enabled = bool(getattr(block, "enabled", self.enabled))
        if self.enabled:
            self.verbose = bool(getattr(block, "verbose", self.verbose))
            self.debug = bool(getattr(block, "debug", self.debug))
            self.prof_ops = list(getattr(block, "prof_ops", self.prof_ops))
            self.prof_all = bool(getattr(block, "prof_all", self.prof_all))

    def start_profiling_comms(self) -> None:
        """Profile every collective from now on."""
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        """Stop profiling collectives not listed in ``prof_ops``."""
        self.prof_all = False

    def start_profiling_op(self, op_name_list: list[str]) -> None:
        """Add ``op_name_list`` to the profiled operations."""
        self.prof_ops = sorted(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list: list[str]) -> None:
        """Remove ``op_name_list`` from the profiled operations."""
        self.prof_ops = [op for op in self.prof_ops if op not in op_name_list]

    def should_profile(self, log_name: str | None, prof: bool) -> bool:
        """Whether a call with this ``log_name``/``prof`` flag is recorded."""
        return self.enabled and (prof or self.prof_all or (log_name is not None and log_name in self.prof_ops))

    def append(self, raw_name: str, record_name: str, latency: float, msg_size: int) -> None:
        """Record one call: ``latency`` in milliseconds, ``msg_size`` in bytes."""
        algbw, busbw = calc_bw_log(raw_name, msg_size, latency, self.world_size)
        by_size = self.comms_dict.setdefault(record_name, {})
        entry = by_size.setdefault(msg_size, [0, [], [], []])
        entry[0] += 1
        entry[1].append(latency)
        entry[2].append(algbw)
        entry[3].append(busbw)
        if self.verbose:
            logger.info(
                f"rank={self.rank} | comm op: {record_name} | time (ms): {latency:.2f} | "
                f"msg size: {convert_size(msg_size)} | algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}"
            )

    def reset_data(self) -> None:
        """Forget every record."""
        self.comms_dict.clear()

    def has_data(self) -> bool:
        """True when at least one call was recorded."""
        return bool(self.comms_dict)

    def get_total_operations(self) -> int:
        """Number of recorded calls across all operations."""
        return sum(entry[0] for by_size in self.comms_dict.values() for entry in by_size.values())

    def get_operation_names(self) -> list[str]:
        """Names of the operations that have records."""
        return list(self.comms_dict)

    def _summary(self) -> dict[str, dict[int, dict[str, Any]]]:
        summary: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
        for name, by_size in self.comms_dict.items():
            for size, (count, lats, algbws, busbws) in sorted(by_size.items()):
                summary[name][size] = {
                    "count": count,
                    "total_latency_ms": sum(lats),
                    "avg_latency_ms": sum(lats) / count,
                    "tput_avg_gbps": sum(algbws) / count,
                    "busbw_avg_gbps": sum(busbws) / count,
                    "msg_size_bytes": size,
                    "msg_size_str": convert_size(size),
                }
        return dict(summary)

    def log_all(self, print_log: bool = True, show_straggler: bool = False, return_dict: bool = False) -> Any:
        """Log a table of all records (when ``print_log``) and optionally return them as a dict.

        ``show_straggler`` is accepted for signature compatibility; straggler analysis needs extra collectives
        and is not implemented (the returned ``straggler_analysis`` is ``None``).
        """
        summary = self._summary()
        if print_log:
            lines = [
                f"{'Comm. Op':<24}{'Message Size':<16}{'Count':<8}{'Total Latency(ms)':<20}"
                f"{'Avg Latency(ms)':<18}{'tput_avg (Gbps)':<18}{'busbw_avg (Gbps)':<18}"
            ]
            for name, by_size in summary.items():
                for row in by_size.values():
                    lines.append(
                        f"{name:<24}{row['msg_size_str']:<16}{row['count']:<8}"
                        f"{row['total_latency_ms']:<20.2f}{row['avg_latency_ms']:<18.2f}"
                        f"{row['tput_avg_gbps']:<18.2f}{row['busbw_avg_gbps']:<18.2f}"
                    )
            logger.info("\n" + "\n".join(lines))
        if not return_dict:
            return None
        metadata = {"world_size": self.world_size, "rank": self.rank, "timestamp": datetime.datetime.now().isoformat()}
        return {"summary": summary, "straggler_analysis": None, "metadata": metadata}
