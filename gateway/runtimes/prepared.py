"""Session containers started ahead of need: a few per container shape, each taken by one session.

Opening a container (``podman run``, the network set, ``inspect``) costs about a second on a loaded
host, on the critical path of every session that brings an image. A node that just opened a container
of some shape (image, limits, network, mounts) is likely to open more of it (a group's other samples, the
next step's), so it starts up to ``per_shape`` more in the background, while its sessions run or its
trainer steps. ``take`` hands one out and forgets it: a prepared container serves exactly one session
and is removed by that session's teardown, as a container opened on demand is, so isolation is the same.

Every start, prepared or on demand, passes ``StartGate``: at most ``max_starting`` containers starting at
once and at most ``starts_per_s`` started per second, so a large node does not stall its host. Prepared
containers carry the node's owner label like any other (podman.py): a killed node's are removed by the
next node's ``cleanup``. Ones not taken within ``max_idle_s`` are removed (a task's image that no session
asks for again), as are all of them when the node stops (``discard``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from contextlib import asynccontextmanager
from typing import Any

log = logging.getLogger("polarstream.node")


class StartGate:
    """At most ``max_starting`` starts at once, and starts no closer together than 1/``starts_per_s``.
    A start ``ahead`` of need waits while any start for a waiting session is asked for or under way:
    on a loaded host they would only slow each other, and the session's is the one on the critical path."""

    def __init__(self, max_starting: int = 4, starts_per_s: float = 8.0):
        if max_starting < 1 or starts_per_s <= 0:
            raise ValueError("max_starting must be >= 1 and starts_per_s > 0")
        self._slots = asyncio.Semaphore(max_starting)
        self._interval = 1.0 / starts_per_s
        self._next = 0.0  # monotonic time the next start may begin
        self.starting = 0  # starts in progress now (observed by tests and metrics)
        self.peak = 0
        self._needed = 0  # starts for a waiting session, asked for or under way
        self._no_need = asyncio.Event()
        self._no_need.set()

    @asynccontextmanager
    async def start(self, ahead: bool = False):
        if ahead:
            while self._needed:
                await self._no_need.wait()
        else:
            self._needed += 1
            self._no_need.clear()
        try:
            async with self._start():
                yield
        finally:
            if not ahead:
                self._needed -= 1
                if not self._needed:
                    self._no_need.set()

    @asynccontextmanager
    async def _start(self):
        async with self._slots:
            now = time.monotonic()
            at = max(now, self._next)
            self._next = at + self._interval
            if at > now:
                await asyncio.sleep(at - now)
            self.starting += 1
            self.peak = max(self.peak, self.starting)
            try:
                yield
            finally:
                self.starting -= 1


class PreparedContainers:
    """Containers started ahead of need, by shape. ``start(shape)`` starts one (through the gate) and
    returns it; ``remove(box)`` removes one."""

    def __init__(self, start: Callable[[Hashable], Awaitable[Any]], remove: Callable[[Any], Awaitable[None]],
                 per_shape: int, max_idle_s: float = 300.0):
        self._start, self._remove = start, remove
        self.per_shape, self.max_idle_s = per_shape, max_idle_s
        self._ready: dict[Hashable, list[tuple[float, Any]]] = {}
        self._starting: dict[Hashable, int] = {}
        self._tasks: set[asyncio.Task] = set()  # starts in progress
        self._removing: set[asyncio.Task] = set()
        self.taken = 0  # sessions served by a prepared container (metrics)

    def take(self, shape: Hashable) -> Any | None:
        """A prepared container of ``shape``, now the caller's alone, or None."""
        boxes = self._ready.get(shape)
        if not boxes:
            return None
        _, box = boxes.pop(0)
        self.taken += 1
        return box

    def ready(self, shape: Hashable | None = None) -> int:
        """How many are prepared (of ``shape``, or in all)."""
        if shape is not None:
            return len(self._ready.get(shape, ()))
        return sum(len(b) for b in self._ready.values())

    def want(self, shape: Hashable) -> None:
        """Start more of ``shape`` in the background, up to ``per_shape`` prepared or starting; drop
        the ones idle past ``max_idle_s``."""
        self._expire()
        missing = self.per_shape - self.ready(shape) - self._starting.get(shape, 0)
        for _ in range(max(0, missing)):
            self._starting[shape] = self._starting.get(shape, 0) + 1
            task = asyncio.ensure_future(self._prepare(shape))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _prepare(self, shape: Hashable) -> None:
        try:
            box = await self._start(shape)
        except Exception as e:  # the session that asks next opens its own and reports the error
            log.warning("preparing a container failed: %s", e)
            return
        finally:
            self._starting[shape] -= 1
        self._ready.setdefault(shape, []).append((time.monotonic(), box))
        # a container no session takes is removed after max_idle_s, whether or not the node opens another
        asyncio.get_running_loop().call_later(self.max_idle_s + 1.0, self._expire)  # after discard: nothing left

    def _expire(self) -> None:
        now = time.monotonic()
        for shape, boxes in self._ready.items():
            old = [b for at, b in boxes if now - at > self.max_idle_s]
            if old:
                self._ready[shape] = [(at, b) for at, b in boxes if now - at <= self.max_idle_s]
                for box in old:
                    self._spawn_remove(box)

    def _spawn_remove(self, box: Any) -> None:
        task = asyncio.ensure_future(self._remove(box))
        self._removing.add(task)
        task.add_done_callback(self._removing.discard)

    async def discard(self) -> None:
        """Stop preparing and remove every prepared container (the node stops)."""
        starting = list(self._tasks)
        for t in starting:  # one cancelled mid-start may leave its container: the next node's cleanup takes it
            t.cancel()
        await asyncio.gather(*starting, return_exceptions=True)
        boxes = [b for bs in self._ready.values() for _, b in bs]
        self._ready.clear()
        await asyncio.gather(*(self._remove(b) for b in boxes), *list(self._removing), return_exceptions=True)
