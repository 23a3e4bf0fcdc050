"""No acknowledged event is lost: the publisher keeps delivering while the broker process is killed and
restarted, and a consumer deduping by event_id counts exactly the acknowledged events."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from infra.process import free_port
from producers.consumer import Deduper, RecordConsumer
from producers.publisher import Publisher, PublishError
from schemas import SessionEvent

N = 300


def _events(n: int) -> list[SessionEvent]:
    return [SessionEvent(session_id=f"s-{i % 17}", kind="started", detail=str(i)) for i in range(n)]


@pytest.mark.parametrize("force", [True, False], ids=["sigkill", "sigterm"])
def test_publisher_survives_broker_restart(infra, polar_settings, force):
    events = _events(N)
    acked: set[str] = set()
    failed: list[PublishError] = []
    submitted = threading.Event()
    third = threading.Event()

    async def produce() -> None:
        async with Publisher(polar_settings, delivery_timeout_s=90) as pub:
            async def one(ev: SessionEvent) -> None:
                try:
                    await pub.publish(ev)
                    acked.add(ev.event_id)
                except PublishError as e:
                    failed.append(e)

            tasks = []
            for i, ev in enumerate(events):
                tasks.append(asyncio.create_task(one(ev)))
                if i == N // 3:
                    third.set()
                await asyncio.sleep(0.01)  # a steady stream that spans the restart
            submitted.set()
            await asyncio.gather(*tasks)

    # The publisher's event loop runs in a thread so the main thread can restart the broker (the
    # broker is started from the main thread so that it dies with the test session if that is killed).
    producer = threading.Thread(target=asyncio.run, args=(produce(),))
    producer.start()
    assert third.wait(60)
    infra.kafka.restart(force=force)
    producer.join(120)
    assert not producer.is_alive()
    assert submitted.is_set()

    assert failed == []
    assert len(acked) == N

    dedupe = Deduper()
    raw = 0
    with RecordConsumer(polar_settings, topics=["session-events"]) as consumer:
        deadline = time.monotonic() + 60
        while len(dedupe) < N and time.monotonic() < deadline:
            for item in consumer.poll(0.5):
                raw += 1
                dedupe.seen(item.record.event_id)
    assert len(dedupe) == N
    assert {e.event_id for e in events} == acked == set(dedupe._ids)
    assert raw - dedupe.duplicates == N  # any re-delivery is recognised as one


async def test_unacknowledged_publish_raises(polar_settings):
    # No broker at this address: the record can never be acknowledged, so the caller must hear so.
    nowhere = polar_settings.model_copy(update={"kafka_bootstrap": f"127.0.0.1:{free_port()}"})
    pub = Publisher(nowhere, delivery_timeout_s=1.0, config={"log_level": 0})
    started = time.monotonic()
    with pytest.raises(PublishError) as e:
        await pub.publish(_events(1)[0])
    assert time.monotonic() - started < 10
    assert e.value.code == "_MSG_TIMED_OUT" and e.value.retriable
    assert pub.stats.failed == 1 and pub.stats.acked == 0
    assert await pub.aclose() == 0


def test_close_fails_whatever_was_not_delivered(polar_settings):
    nowhere = polar_settings.model_copy(update={"kafka_bootstrap": f"127.0.0.1:{free_port()}"})
    pub = Publisher(nowhere, delivery_timeout_s=60, config={"log_level": 0})
    futures = [pub.submit(ev) for ev in _events(5)]
    assert pub.close(timeout=0.5) == 5
    for fut in futures:
        with pytest.raises(PublishError, match="not acknowledged"):
            fut.result(5)
    with pytest.raises(PublishError, match="closed"):
        pub.submit(_events(1)[0])


async def test_full_queue_is_back_pressure_not_loss(polar_settings):
    # A queue of 5 messages and 60 concurrent publishers: most must wait for room, none may fail.
    events = _events(60)
    async with Publisher(polar_settings, max_in_flight=5) as pub:
        deliveries = await asyncio.gather(*(pub.publish(ev) for ev in events))
        assert pub.stats.acked == 60 and pub.stats.failed == 0
        assert pub.stats.queue_full > 0  # the bound was really hit
    assert sorted(d.event_id for d in deliveries) == sorted(e.event_id for e in events)
    assert len({(d.partition, d.offset) for d in deliveries}) == 60


async def test_publish_many_waits_for_room_and_answers_in_order(polar_settings):
    # One batch through a queue of 5: it must wait for room many times, lose nothing and answer each
    # record's delivery in the records' order, served partly by the batch itself and partly by the poll thread.
    events = _events(200)
    async with Publisher(polar_settings, max_in_flight=5) as pub:
        assert await pub.publish_many([]) == []
        deliveries = await pub.publish_many(events)
        assert pub.stats.acked == 200 and pub.stats.failed == 0 and pub.stats.queue_full > 0
    assert [d.event_id for d in deliveries] == [e.event_id for e in events]
    assert len({(d.partition, d.offset) for d in deliveries}) == 200


async def test_publish_many_raises_when_not_acknowledged(polar_settings):
    nowhere = polar_settings.model_copy(update={"kafka_bootstrap": f"127.0.0.1:{free_port()}"})
    pub = Publisher(nowhere, delivery_timeout_s=1.0, config={"log_level": 0})
    with pytest.raises(PublishError) as e:
        await pub.publish_many(_events(40))
    assert e.value.code == "_MSG_TIMED_OUT" and e.value.retriable
    assert await pub.aclose() == 0
    assert pub.stats.failed == 40 and pub.stats.acked == 0  # every record's outcome was counted
