"""Hostfile parsing and --include/--exclude resolution (pure functions, no processes)."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from deepspeed.launcher.hostfile import decode_world_info
from deepspeed.launcher.runner import (
    _parse_hostfile,
    encode_world_info,
    fetch_hostfile,
    parse_inclusion_exclusion,
    parse_resource_filter,
)


def test_parse_good_hostfile_keeps_order() -> None:
    pool = _parse_hostfile(["worker-1 slots=4\n", "worker-0 slots=2\n"])
    assert list(pool.items()) == [("worker-1", 4), ("worker-0", 2)]


def test_parse_skips_comments_blank_lines_and_extra_keys() -> None:
    lines = ["# cluster A\n", "\n", "   \n", "a slots=8  # the big one\n", "b  slots = 2 max_slots=4\n"]
    assert _parse_hostfile(lines) == OrderedDict(a=8, b=2)


@pytest.mark.parametrize(
    "bad_line",
    ["worker-0", "worker-0 slots=", "worker-0 slots=two", "worker-0 gpus=2", "worker-0 slots=4x", "slots=4"],
)
def test_parse_rejects_malformed_line_naming_it(bad_line: str) -> None:
    with pytest.raises(ValueError, match=r"line 2 is malformed") as err:
        _parse_hostfile(["ok slots=1", bad_line])
    assert bad_line.strip() in str(err.value)


def test_parse_rejects_duplicate_host() -> None:
    with pytest.raises(ValueError, match=r"line 3: host 'a' is listed more than once"):
        _parse_hostfile(["a slots=1", "b slots=1", "a slots=2"])


def test_parse_rejects_zero_slots_and_empty_file() -> None:
    with pytest.raises(ValueError, match="slots must be >= 1"):
        _parse_hostfile(["a slots=0"])
    with pytest.raises(ValueError, match="empty"):
        _parse_hostfile(["# nothing here", ""])


def test_fetch_hostfile_missing_is_none_and_errors_name_the_file(tmp_path) -> None:
    assert fetch_hostfile(str(tmp_path / "absent")) is None
    path = tmp_path / "hosts"
    path.write_text("a slots=2\nb slots\n")
    with pytest.raises(ValueError, match=rf"^{path}: hostfile line 2 is malformed"):
        fetch_hostfile(str(path))
    path.write_text("a slots=2\nb slots=3\n")
    assert fetch_hostfile(str(path)) == OrderedDict(a=2, b=3)


POOL = OrderedDict([("w0", 4), ("w1", 4), ("w2", 2)])


def test_no_filter_uses_every_slot() -> None:
    assert parse_inclusion_exclusion(POOL, "", "") == OrderedDict(w0=[0, 1, 2, 3], w1=[0, 1, 2, 3], w2=[0, 1])


def test_include_hosts_and_slots_keeps_hostfile_order() -> None:
    active = parse_inclusion_exclusion(POOL, "w2@w0:3,1,3", "")
    assert list(active.items()) == [("w0", [3, 1]), ("w2", [0, 1])]


def test_exclude_host_and_slots_drops_emptied_hosts() -> None:
    assert parse_inclusion_exclusion(POOL, "", "w1@w0:0,1") == OrderedDict(w0=[2, 3], w2=[0, 1])
    assert parse_inclusion_exclusion(POOL, "", "w2:0,1") == OrderedDict(w0=[0, 1, 2, 3], w1=[0, 1, 2, 3])


@pytest.mark.parametrize(
    ("include", "exclude", "message"),
    [
        ("w9", "", "host 'w9' is not in the resource pool"),
        ("w2:2", "", "slot 2 is not available on host 'w2'"),
        ("", "w0:7", "slot 7 is not available on host 'w0'"),
        ("w0:a", "", "slot 'a' in 'w0:a' is not a non-negative integer"),
        ("w0:", "", "malformed resource filter entry"),
        ("w0@@w1", "", "malformed resource filter entry"),
        ("w0", "w1", "mutually exclusive"),
    ],
)
def test_filter_errors(include: str, exclude: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_inclusion_exclusion(POOL, include, exclude)


def test_parse_resource_filter_takes_slot_lists() -> None:
    assert parse_resource_filter({"h": [0, 2, 5]}, include_str="h:5,0") == OrderedDict(h=[5, 0])


def test_world_info_round_trip_keeps_host_order() -> None:
    info = OrderedDict([("zeta", [1]), ("alpha", [0, 1])])
    encoded = encode_world_info(info)
    assert encoded.replace("-", "").replace("_", "").replace("=", "").isalnum()
    assert list(decode_world_info(encoded).items()) == list(info.items())
    with pytest.raises(ValueError, match="world_info"):
        decode_world_info("not base64 json!!")
