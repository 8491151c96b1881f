"""The arrival record of the ZeRO-3 early host step ([Note: final gradient count]): the first backward records, a
later one makes a chunk final once all of its parameters arrived as often as recorded, and every difference from
the record either keeps the chunk for step() or, once the chunk was submitted, is reported."""

from __future__ import annotations

from deepspeed._core.layout.shards import Range
from deepspeed._core.optim.early_step import ArrivalRecord, RegionSpan

# One group of 10 elements in chunks of 4: parameter 1 holds [0, 6), parameter 2 holds [6, 10).
REGIONS = [RegionSpan(1, 0, Range(0, 6)), RegionSpan(2, 0, Range(6, 10))]
A, B, C = (0, 0, 4), (0, 4, 8), (0, 8, 10)


def _recorded(arrivals: dict[int, int]) -> ArrivalRecord:
    record = ArrivalRecord(REGIONS, [10], 4)
    record.begin()
    for key, n in arrivals.items():
        for _ in range(n):
            assert record.arrive(key, landed=True) == []  # the recording backward submits nothing
    record.end()
    return record


def test_a_chunk_is_final_once_every_parameter_in_it_arrived_as_often_as_recorded() -> None:
    record = _recorded({1: 1, 2: 2})
    record.begin()
    assert record.arrive(2, landed=True) == []  # one of two
    assert record.late(2) == []
    assert record.arrive(2, landed=True) == [C]  # C holds parameter 2 only; B waits for parameter 1
    assert record.arrive(1, landed=False) == []  # final, but held until its parameter's release
    assert record.landed(1) == [A, B]
    record.end()
    assert record.unstable == set()


def test_differences_from_the_record_keep_chunks_for_step_or_are_reported() -> None:
    record = _recorded({1: 1, 2: 0})
    record.begin()
    assert record.late(2) == []  # recorded with none: nothing of it was submitted
    assert record.arrive(2, landed=True) == []  # and it never is
    assert record.arrive(1, landed=True) == [A]  # B holds parameter 2 too
    assert record.late(1) == [A]  # one more arrival of parameter 1: too late for A
    record.end()
    assert record.unstable == {1, 2}
    record.begin()
    assert record.arrive(1, landed=True) == []  # unstable from then on


def test_fewer_arrivals_than_recorded_turn_a_parameter_unstable() -> None:
    record = _recorded({1: 2, 2: 1})
    record.begin()
    assert record.arrive(1, landed=True) == []
    record.end()
    assert record.unstable == {1, 2}
