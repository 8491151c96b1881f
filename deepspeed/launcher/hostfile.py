"""Hostfile parsing and ``--include``/``--exclude`` resolution: pure functions over ``{host: slots}``.

A *resource pool* maps a host name to its slot count (``{"worker-0": 8}``), as read from a hostfile.
*Active resources* map a host name to the list of slot ids that will run a rank (``{"worker-0": [0, 1]}``);
their order (hosts, then slots) is the order in which global ranks are assigned.
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping

from deepspeed._foundation.logging import logger

# `slots=N` may be followed by other OpenMPI hostfile keys (e.g. `max_slots=16`), which we ignore, but
# not glued to other characters: `slots=4x` is a typo, not four slots.
_HOSTFILE_LINE = re.compile(r"^(?P<host>\S+)\s+slots\s*=\s*(?P<slots>\d+)(?:\s+.*)?$")


def _parse_hostfile(hostfile_lines: Iterable[str]) -> OrderedDict[str, int]:
    """Parse hostfile text lines into an ordered ``{host: slot count}``.

    Blank lines and lines starting with ``#`` are skipped; a trailing ``# comment`` is allowed.

    Raises:
        ValueError: naming the 1-based line number, for a malformed line, a zero slot count or a
            host listed twice; or when no host is listed at all.
    """
    pool: OrderedDict[str, int] = OrderedDict()
    for lineno, raw in enumerate(hostfile_lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOSTFILE_LINE.match(line)
        if match is None:
            raise ValueError(f"hostfile line {lineno} is malformed: {raw.strip()!r} (expected 'hostname slots=N')")
        host, slots = match.group("host"), int(match.group("slots"))
        if slots < 1:
            raise ValueError(f"hostfile line {lineno}: host {host!r} has slots={slots}; slots must be >= 1")
        if host in pool:
            raise ValueError(f"hostfile line {lineno}: host {host!r} is listed more than once")
        pool[host] = slots
    if not pool:
        raise ValueError("hostfile is empty or lists no 'hostname slots=N' line")
    return pool


def fetch_hostfile(hostfile_path: str) -> OrderedDict[str, int] | None:
    """Read a hostfile into an ordered ``{host: slot count}``.

    Returns ``None`` (and logs) when the file does not exist, which means "local resources only".

    Raises:
        ValueError: the file exists but is malformed; the message starts with the file's path.
    """
    if not os.path.isfile(hostfile_path):
        logger.info(f"No hostfile at {hostfile_path}; using local resources only.")
        return None
    with open(hostfile_path) as fd:
        lines = fd.readlines()
    try:
        return _parse_hostfile(lines)
    except ValueError as err:
        raise ValueError(f"{hostfile_path}: {err}") from None


def _stable_remove_duplicates(data: Iterable[int]) -> list[int]:
    """``data`` without repeats, first occurrence kept, order preserved."""
    return list(dict.fromkeys(data))


def _parse_filter_entry(entry: str, host_info: Mapping[str, list[int]]) -> tuple[str, list[int] | None]:
    """Split ``host[:slot,slot...]`` into the host and its slots (``None``: the whole host), validated."""
    host, sep, slot_text = entry.partition(":")
    if not host or (sep and not slot_text):
        raise ValueError(f"malformed resource filter entry {entry!r} (expected 'host' or 'host:slot[,slot...]')")
    if host not in host_info:
        raise ValueError(f"host {host!r} is not in the resource pool {sorted(host_info)}")
    if not sep:
        return host, None
    slots = []
    for token in slot_text.split(","):
        if not token.strip().isdigit():
            raise ValueError(f"slot {token!r} in {entry!r} is not a non-negative integer")
        slot = int(token)
        if slot not in host_info[host]:
            raise ValueError(f"slot {slot} is not available on host {host!r} (available: {host_info[host]})")
        slots.append(slot)
    return host, slots


def parse_resource_filter(
    host_info: Mapping[str, list[int]], include_str: str = "", exclude_str: str = ""
) -> OrderedDict[str, list[int]]:
    """Apply an ``--include`` or ``--exclude`` filter (``host[:slot,...][@host...]``) to ``host_info``.

    ``host_info`` maps each host to its available slot ids. The result keeps ``host_info``'s host order,
    drops hosts left with no slot, and keeps each host's slots in the order given (repeats removed).

    Raises:
        ValueError: both filters given, or a host or slot that ``host_info`` does not have.
    """
    if include_str and exclude_str:
        raise ValueError("--include and --exclude are mutually exclusive")
    if not include_str and not exclude_str:
        return OrderedDict((host, list(slots)) for host, slots in host_info.items())
    including = bool(include_str)
    chosen: dict[str, list[int]] = {} if including else {host: list(slots) for host, slots in host_info.items()}
    for entry in (include_str or exclude_str).split("@"):
        host, slots = _parse_filter_entry(entry.strip(), host_info)
        if including:
            chosen.setdefault(host, []).extend(host_info[host] if slots is None else slots)
        elif slots is None:
            chosen.pop(host, None)
        else:
            chosen[host] = [s for s in chosen.get(host, []) if s not in slots]
    return OrderedDict((host, _stable_remove_duplicates(chosen[host])) for host in host_info if chosen.get(host))


def parse_inclusion_exclusion(
    resource_pool: Mapping[str, int], inclusion: str, exclusion: str
) -> OrderedDict[str, list[int]]:
    """Turn a ``{host: slot count}`` pool into active ``{host: [slot ids]}`` after include/exclude filters."""
    host_info = OrderedDict((host, list(range(count))) for host, count in resource_pool.items())
    return parse_resource_filter(host_info, include_str=inclusion, exclude_str=exclusion)


def encode_world_info(world_info: Mapping[str, list[int]]) -> str:
    """Encode ``{host: [slot ids]}`` as URL-safe base64 JSON, the ``--world_info`` wire format."""
    return base64.urlsafe_b64encode(json.dumps(dict(world_info)).encode("utf-8")).decode("utf-8")


def decode_world_info(world_info_base64: str) -> OrderedDict[str, list[int]]:
    """Inverse of :func:`encode_world_info`; host order is preserved (it decides rank order)."""
    try:
        decoded = json.loads(base64.urlsafe_b64decode(world_info_base64), object_pairs_hook=OrderedDict)
    except (ValueError, TypeError) as err:
        raise ValueError(f"--world_info is not valid base64-encoded JSON: {err}") from None
    # object_pairs_hook turns every JSON object into an OrderedDict; anything else is not a mapping.
    if not isinstance(decoded, OrderedDict) or not all(isinstance(v, list) for v in decoded.values()):
        raise ValueError("--world_info must encode a {host: [slot ids]} mapping")
    return decoded
