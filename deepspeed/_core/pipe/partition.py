"""Splitting a list of layers into contiguous pipeline stages: pure functions of per-layer weights.

A partition is the list ``parts`` of ``num_stages + 1`` boundaries: stage ``s`` owns layers
``parts[s] <= i < parts[s + 1]``. Every stage owns at least one layer.

Methods (``PipelineModule(partition_method=...)``, case-insensitive):

- ``uniform``: equal layer counts (the first ``n % stages`` stages get one extra layer);
- ``parameters``: balance the parameter counts (weights counted on the meta device, so nothing is materialised);
- ``type:<regex>``: balance the number of layers whose class name matches ``<regex>`` (case-insensitive), e.g.
  ``type:transformer`` gives every stage the same number of transformer blocks.

Balancing minimises the heaviest stage exactly (binary search over the bottleneck, greedy fill), and among optimal
splits fills earlier stages first, so layers of weight zero after the last heavy layer of a stage (a final norm, a
head without parameters) join the later stage.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

VALID_METHODS = "'parameters', 'uniform', 'type:<regex>'"


class PartitionError(ValueError):
    """The layers cannot be split as asked; the message names the setting and what is valid."""


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries giving every part ``num_items // num_parts`` items, the first ``num_items % num_parts`` one more."""
    _check_counts(num_items, num_parts)
    base, extra = divmod(num_items, num_parts)
    parts = [0]
    for p in range(num_parts):
        parts.append(parts[-1] + base + (1 if p < extra else 0))
    return parts


def _check_counts(num_items: int, num_parts: int) -> None:
    if num_parts < 1:
        raise PartitionError(f"num_stages must be >= 1, got {num_parts}")
    if num_items < num_parts:
        raise PartitionError(
            f"cannot partition {num_items} layers into {num_parts} pipeline stages: every stage "
            f"needs at least one layer (use fewer stages or more layers)"
        )


def _greedy(weights: Sequence[int], num_parts: int, bound: int) -> list[int] | None:
    """Fill stages left to right up to ``bound``, leaving one layer for each later stage; None if over ``bound``."""
    n = len(weights)
    parts = [0]
    start = 0
    for p in range(num_parts - 1):
        stop, total = start, 0
        # Take at least one layer; keep taking while under the bound and enough layers remain for later stages.
        while stop < n - (num_parts - 1 - p) and (stop == start or total + weights[stop] <= bound):
            total += weights[stop]
            stop += 1
        parts.append(stop)
        start = stop
    parts.append(n)
    if sum(weights[start:]) > bound:
        return None
    return parts


def partition_balanced(weights: Sequence[int], num_parts: int) -> list[int]:
    """Contiguous boundaries minimising the largest per-part sum of ``weights`` (non-negative ints)."""
    _check_counts(len(weights), num_parts)
    if any(w < 0 for w in weights):
        raise PartitionError("partition weights must be non-negative")
    lo, hi = max(weights, default=0), sum(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        if _greedy(weights, num_parts, mid) is None:
            lo = mid + 1
        else:
            hi = mid
    parts = _greedy(weights, num_parts, lo)
    assert parts is not None  # lo == sum(weights) is always feasible
    return parts


def type_weights(class_names: Sequence[str], pattern: str) -> list[int]:
    """1 for every layer whose class name matches ``pattern`` (case-insensitive search), else 0."""
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error as err:
        raise PartitionError(f"partition_method 'type:{pattern}': invalid regular expression ({err})") from err
    return [1 if regex.search(name) else 0 for name in class_names]


def parse_method(method: str) -> tuple[str, str]:
    """``(kind, argument)`` of a partition method string; raises naming the valid methods."""
    if not isinstance(method, str):
        raise PartitionError(f"partition_method must be a string ({VALID_METHODS}), got {method!r}")
    lowered = method.lower()
    if lowered in ("parameters", "uniform"):
        return lowered, ""
    if lowered.startswith("type:"):
        pattern = method[len("type:") :]
        if not pattern:
            raise PartitionError("partition_method 'type:' needs a regular expression after the colon")
        return "type", pattern
    raise PartitionError(f"partition_method {method!r} is not supported; valid: {VALID_METHODS}")


def partition_layers(
    method: str, num_stages: int, class_names: Sequence[str], param_counts: Sequence[int] | None
) -> list[int]:
    """Stage boundaries for ``method`` over layers described by class names and (for ``parameters``) counts."""
    kind, pattern = parse_method(method)
    _check_counts(len(class_names), num_stages)
    if kind == "uniform":
        return partition_uniform(len(class_names), num_stages)
    if kind == "parameters":
        assert param_counts is not None and len(param_counts) == len(class_names)
        return partition_balanced(list(param_counts), num_stages)
    weights = type_weights(class_names, pattern)
    matched = sum(weights)
    if matched == 0:
        raise PartitionError(
            f"partition_method 'type:{pattern}' matches none of the layer classes {sorted(set(class_names))}"
        )
    if matched < num_stages:
        raise PartitionError(
            f"partition_method 'type:{pattern}' matches {matched} layers, fewer than the {num_stages} pipeline stages"
        )
    return partition_balanced(weights, num_stages)
