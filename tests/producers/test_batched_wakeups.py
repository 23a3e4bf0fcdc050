"""Acknowledgements reach an event loop in batches: every future resolved, few loop wakeups, none lost.

No broker: ``_LoopDeliveries`` is fed from a thread the way the poll thread feeds it.
"""

from __future__ import annotations

import asyncio
import threading

from producers.publisher import Delivery, PublishError, _LoopDeliveries


def _delivery(i: int) -> Delivery:
    return Delivery("t", 0, i, f"e{i}", 0.1)


async def test_outcomes_from_another_thread_resolve_every_future_in_few_wakeups():
    loop = asyncio.get_running_loop()
    drains = 0

    class Counting(_LoopDeliveries):
        def drain(self) -> None:
            nonlocal drains
            drains += 1
            super().drain()

    deliveries = Counting(loop)
    futures = [loop.create_future() for _ in range(2000)]
    futures[7].cancel()  # a caller that stopped waiting: its outcome is dropped, nothing raises

    def poll_thread() -> None:
        for i, fut in enumerate(futures):
            deliveries.put(fut, _delivery(i) if i % 100 else PublishError("not acknowledged", event_id=f"e{i}"))

    thread = threading.Thread(target=poll_thread)
    thread.start()
    results = await asyncio.gather(*futures, return_exceptions=True)
    thread.join()
    assert isinstance(results[7], asyncio.CancelledError)
    assert all(isinstance(r, PublishError) for i, r in enumerate(results) if i % 100 == 0)
    assert [r.offset for i, r in enumerate(results) if i % 100 and i != 7] == [i for i in range(2000) if i % 100 and i != 7]
    assert 1 <= drains < len(futures) // 4  # batched: far fewer wakeups than outcomes
    assert not deliveries.pending and not deliveries.scheduled


async def test_a_lone_outcome_wakes_the_loop_at_once():
    loop = asyncio.get_running_loop()
    deliveries = _LoopDeliveries(loop)
    for i in range(3):  # one at a time, as a single waiting caller sees it
        fut = loop.create_future()
        threading.Thread(target=deliveries.put, args=(fut, _delivery(i))).start()
        assert (await asyncio.wait_for(fut, 5)).offset == i
