"""Changelog records held back until a flush: the last value of each key, in the order of last writes."""

from __future__ import annotations

from streams.changelog import Changelog


class _Table:
    """What Changelog needs of a faust Table: its send_changelog, here recording what it was given."""

    def __init__(self, sent: list):
        self.sent = sent

    def send_changelog(self, partition, key, value, key_serializer=None, value_serializer=None):
        self.sent.append((self, partition, key, value, value_serializer))


def test_only_the_last_write_of_a_key_goes_out_in_last_write_order():
    sent: list = []
    a, b = _Table(sent), _Table(sent)
    log = Changelog({"a": a, "b": b})
    log.note("a", "s", 3, b"1", held=False)
    log.note("b", "s/0", 3, b"ref", held=False)
    log.note("a", "s", 3, b"2", held=True)  # rewritten: goes out once, after b's write
    log.note("b", "kept", 1, None, held=True)  # deleted, and the changelog held it: a tombstone
    assert log.flush() == 3
    assert sent == [(b, 3, "s/0", b"ref", None), (a, 3, "s", b"2", None), (b, 1, "kept", None, "raw")]
    assert log.flush() == 0 and len(sent) == 3  # nothing twice


def test_a_key_written_and_deleted_between_flushes_sends_nothing_unless_the_changelog_held_it():
    sent: list = []
    t = _Table(sent)
    log = Changelog({"t": t})
    log.note("t", "new", 0, b"x", held=False)
    log.note("t", "new", 0, None, held=True)  # held by the table, but only since this flush window
    log.note("t", "old", 0, b"y", held=True)
    log.note("t", "old", 0, None, held=True)
    log.flush()
    assert sent == [(t, 0, "old", None, "raw")]
    log.note("t", "new", 0, b"z", held=False)
    log.flush()
    log.note("t", "new", 0, None, held=True)  # sent at the last flush: now it needs its tombstone
    log.flush()
    assert sent[1:] == [(t, 0, "new", b"z", None), (t, 0, "new", None, "raw")]
