"""A stage's input partition is committed only up to inputs its handler returned from.

At a rebalance Faust's stream skips the events already queued for an agent and acks them as if they
were handled; the commit then skipped them for good (the kill test lost a third of its calls in CI).
streams/app._commit_only_handled holds such a partition's commit until the input is delivered again and
handled. Driven through the worker's real Faust consumer and Faust's own ack and commit bookkeeping.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def _message(tp, offset: int):
    from faust.types.tuples import ConsumerMessage

    return ConsumerMessage(tp.topic, tp.partition, offset, 0.0, 0, None, b"k", b"v", None, tp=tp)


@pytest.fixture
def worker(polar_settings):
    from streams.app import create_app
    from streams.config import StreamsConfig

    app = create_app(polar_settings, StreamsConfig())
    rt = app.polar_runtime
    # What the conductor of a started worker holds: the topics its agents read, with acks on (and one
    # more, as if another agent read polar.groups).
    app.topics._acking_topics.update(rt.stage_topics | {rt.topo.groups})
    return rt, app.consumer


def test_a_skipped_input_holds_its_partition_commit_until_it_is_handled(worker):
    from faust.types import TP

    rt, consumer = worker
    tp = TP(rt.topo.calls, 0)
    consumer._committed_offset[tp] = 7
    skipped, handled = _message(tp, 7), _message(tp, 8)
    rt.handled.add(handled)
    assert skipped.ack(consumer) is False  # what Faust's stream does with an event it skips at a rebalance
    assert handled.ack(consumer) is True
    assert consumer._filter_committable_offsets([tp]) == {}  # nothing past offset 7 while it is unhandled
    assert rt.counters["inputs.skipped_by_rebalance"] == 1

    again = _message(tp, 7)  # delivered again after the seek to the committed offset, and handled
    rt.handled.add(again)
    assert again.ack(consumer) is True
    assert consumer._filter_committable_offsets([tp]) == {tp: 9}


def test_a_partition_never_committed_holds_too(worker):
    """Faust's own bookkeeping commits past an unacked head when a partition has no committed offset."""
    from faust.types import TP

    rt, consumer = worker
    tp = TP(rt.topo.session_events, 1)
    skipped, handled = _message(tp, 0), _message(tp, 1)
    rt.handled.add(handled)
    skipped.ack(consumer)
    handled.ack(consumer)
    assert consumer._filter_committable_offsets([tp]) == {}


def test_topics_no_stage_reads_are_acked_as_before(worker):
    from faust.types import TP

    rt, consumer = worker
    tp = TP(rt.topo.groups, 0)  # no stage reads polar.groups
    assert tp.topic not in rt.stage_topics
    assert _message(tp, 0).ack(consumer) is True
