"""When each open session or group needs a look next: per partition, a heap of wake-up times.

A tick of a partition only touches the keys whose wake-up time has come, instead of parsing every
state in the table. A wake-up time is a *lower bound* of the key's real deadline: the stage re-decides
from the stored state when it fires and schedules the next one, so a deadline that moves later (a
session's expiry moves with its last call) needs no update, and one that moves earlier pushes a new
entry (``wake_by``). Superseded heap entries are skipped when popped and compacted away when they pile
up. Nothing here is persisted: after a rebalance (tables recovered from their changelogs) the stage
rebuilds it from its table, once (see ``Runtime.recovered``).
"""

from __future__ import annotations

import heapq


class Wakeups:
    """Per partition, the earliest time each key must be looked at (on one clock: wall time, or the
    calls watermark)."""

    def __init__(self) -> None:
        self._heaps: dict[int, list[tuple[float, str]]] = {}
        self._at: dict[str, tuple[int, float]] = {}  # key -> (partition, wake-up time), the live entry

    def __len__(self) -> int:
        return len(self._at)

    def wake_by(self, partition: int, key: str, at: float) -> None:
        """Make sure ``key`` is looked at no later than ``at`` (``inf``: never needed)."""
        if at == float("inf"):
            return
        held = self._at.get(key)
        if held is not None and held[0] == partition and held[1] <= at:
            return  # already woken earlier; it reschedules itself then
        self._at[key] = (partition, at)
        heap = self._heaps.setdefault(partition, [])
        heapq.heappush(heap, (at, key))
        if len(heap) > 64 and len(heap) > 4 * len(self._at):
            self._compact()

    def discard(self, key: str) -> None:
        self._at.pop(key, None)

    def pop_due(self, partition: int, now: float) -> list[str]:
        """The keys of ``partition`` whose wake-up time is ``<= now``, removed (the caller reschedules)."""
        heap = self._heaps.get(partition)
        out: list[str] = []
        while heap and heap[0][0] <= now:
            at, key = heapq.heappop(heap)
            if self._at.get(key) == (partition, at):
                del self._at[key]
                out.append(key)
        return out

    def _compact(self) -> None:
        heaps: dict[int, list[tuple[float, str]]] = {}
        for key, (partition, at) in self._at.items():
            heaps.setdefault(partition, []).append((at, key))
        for heap in heaps.values():
            heapq.heapify(heap)
        self._heaps = heaps
