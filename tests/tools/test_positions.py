"""Start/stop positions: times and offset files, with errors that name the bad input."""

from __future__ import annotations

import pytest

from producers.positions import PositionError, Span, load_offsets, offsets_of, parse_offsets, parse_time

TOPICS = ("calls", "session-events")


def test_times_in_both_notations_mean_the_same_instant():
    assert parse_time("1764410400") == 1764410400000
    assert parse_time("1764410400.25") == 1764410400250
    assert parse_time("2025-11-29T10:00:00Z") == parse_time("2025-11-29T10:00:00") == parse_time("2025-11-29T11:00:00+01:00")
    assert parse_time("2025-11-29T10:00:00Z") == 1764410400000


@pytest.mark.parametrize("bad", ["yesterday", "-5", "nan", "2025-13-01"])
def test_bad_times_are_named(bad):
    with pytest.raises(PositionError, match="time"):
        parse_time(bad)


def test_offsets_document():
    got = parse_offsets({"calls": {"0": 5, 1: 7}, "polar.session-events": {"3": 0}}, TOPICS)
    assert got == {"calls": {0: 5, 1: 7}, "session-events": {3: 0}}
    spans = [Span("calls", 0, 5, 9), Span("calls", 1, 7, 7)]
    assert offsets_of(spans, "start") == {"calls": {"0": 5, "1": 7}}
    assert parse_offsets(offsets_of(spans), TOPICS) == {"calls": {0: 9, 1: 7}}  # a replay's end_offsets reload


@pytest.mark.parametrize("doc, match", [
    ([], "expected an object"),
    ({"groups": {}}, "'groups' is not one of"),
    ({"calls": [1, 2]}, "calls: expected"),
    ({"calls": {"x": 1}}, "partition 'x'"),
    ({"calls": {"0": -1}}, "calls.0: offset -1"),
    ({"calls": {"0": "12"}}, "offset '12'"),
])
def test_bad_offsets_are_named(doc, match):
    with pytest.raises(PositionError, match=match):
        parse_offsets(doc, TOPICS)


def test_offsets_file_errors_name_the_file(tmp_path):
    with pytest.raises(PositionError, match="no such offsets file"):
        load_offsets(tmp_path / "missing.json", TOPICS)
    bad = tmp_path / "bad.json"
    bad.write_text("{calls: 1")
    with pytest.raises(PositionError, match="bad.json: not valid JSON"):
        load_offsets(bad, TOPICS)
