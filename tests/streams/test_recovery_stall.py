"""Which changelog partitions the worker fetches again during table recovery (streams/app.py)."""

from __future__ import annotations

from streams.app import stalled_partitions


def test_only_a_partition_stuck_below_its_highwater_for_the_stall_time_is_fetched_again():
    highwaters = {"a": 10, "b": 10, "c": -1, "d": 5}
    offsets = {"a": 3, "b": 3, "c": -1, "d": 5}
    seen: dict = {}
    assert stalled_partitions(highwaters, offsets, seen, 0.0, 10.0) == []  # first sight: a wait starts
    offsets["b"] = 4  # b makes progress, a does not
    assert stalled_partitions(highwaters, offsets, seen, 6.0, 10.0) == []
    assert stalled_partitions(highwaters, offsets, seen, 10.0, 10.0) == [("a", 3)]
    assert stalled_partitions(highwaters, offsets, seen, 15.0, 10.0) == []  # a new wait after the seek
    assert stalled_partitions(highwaters, offsets, seen, 16.0, 10.0) == [("b", 4)]
    assert set(seen) == {"a", "b"}  # c (empty) and d (read to its end) are never waited on
    offsets["a"] = 10
    assert stalled_partitions(highwaters, offsets, seen, 30.0, 10.0) == [("b", 4)] and "a" not in seen  # a is done
