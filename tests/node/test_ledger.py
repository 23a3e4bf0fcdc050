"""Partition bookkeeping: commit points, re-delivery after a node died, attempt numbers."""

from __future__ import annotations

import json

from gateway.node.ledger import PartitionLedger


def test_commit_point_advances_over_contiguous_finished():
    led = PartitionLedger.resume("n1", 10, None)
    for off in (10, 11, 12):
        assert not led.deliver(off, 0).skip
    led.finish(11)
    assert led.lowest_open() == 10
    led.finish(10)
    assert led.lowest_open() == 12 and led.done == set()
    meta = json.loads(led.metadata())
    assert meta == {"node": "n1", "live": {"12": 0}, "done": []}


def test_takeover_reruns_live_with_next_attempt_and_skips_done():
    dead = PartitionLedger.resume("n1", 0, None)
    for off in range(4):
        dead.deliver(off, 0)
    dead.finish(1)  # finished out of order: commit stays at 0
    dead.finish(3)
    meta = dead.metadata()
    heir = PartitionLedger.resume("n2", dead.lowest_open(), meta)
    assert heir.deliver(0, 0).__dict__ == {"skip": False, "attempt": 1, "lost_attempt": 0}
    assert heir.deliver(1, 0).skip
    assert heir.deliver(2, 0).attempt == 1
    assert heir.deliver(3, 0).skip
    assert heir.deliver(4, 0).__dict__ == {"skip": False, "attempt": 0, "lost_attempt": None}  # never started before
    # the heir dies too before finishing offset 0: a third node runs it as attempt 2
    third = PartitionLedger.resume("n3", heir.lowest_open(), heir.metadata())
    assert third.deliver(0, 0).attempt == 2


def test_inherited_entries_survive_an_early_commit():
    heir = PartitionLedger.resume("n2", 5, json.dumps({"live": {"5": 0, "6": 3}, "done": [7]}))
    heir.deliver(5, 0)
    heir.finish(5)  # commits before offset 6 was re-delivered to us
    meta = json.loads(heir.metadata())
    assert meta["live"] == {"6": 3} and meta["done"] == [7]


def test_garbage_metadata_is_a_plain_offset():
    led = PartitionLedger.resume("n", 3, "not json")
    assert led.deliver(2, 0).skip and not led.deliver(3, 0).skip


def test_commit_point_follows_the_first_delivery_after_a_gap():
    # no commit yet, and the topic's earliest record is 500 (older ones were removed by retention)
    led = PartitionLedger.resume("n", 0, None)
    led.deliver(500, 0)
    led.finish(500)
    assert led.lowest_open() == 501 and led.done == set()
    # but a gap is never jumped over a session still running
    led.deliver(501, 0)
    led.deliver(510, 0)
    led.finish(510)
    assert led.lowest_open() == 501 and led.done == {510}


def test_a_delivery_taken_back_is_delivered_again_as_the_same_attempt():
    dead = PartitionLedger.resume("n1", 0, None)
    dead.deliver(0, 0)
    heir = PartitionLedger.resume("n2", 0, dead.metadata())
    first = heir.deliver(0, 0)
    assert (first.attempt, first.lost_attempt) == (1, 0)
    heir.undeliver(0, first)  # its live mark could not be committed: not run
    assert json.loads(heir.metadata())["live"] == {"0": 0}  # the lost attempt is still on record
    again = heir.deliver(0, 0)
    assert again.__dict__ == first.__dict__ and not again.skip
    fresh = PartitionLedger.resume("n1", 5, None)
    d = fresh.deliver(5, 0)
    fresh.undeliver(5, d)
    assert fresh.lowest_open() == 5 and fresh.deliver(5, 0).__dict__ == d.__dict__
