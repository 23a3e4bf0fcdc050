"""The pause gate: hold new generations and drain in-flight ones while engine weights are swapped."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

log = logging.getLogger("polarstream.gateway")


class GateClosed(Exception):
    """The gateway stayed paused longer than a held call may wait."""


class Gate:
    """Counts calls in flight; ``pause`` closes the gate and waits until none are."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.in_flight = 0
        self._deadline: asyncio.TimerHandle | None = None
        self.auto_resumed = 0  # pauses that outlived their deadline (a trainer died while paused?)

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    @asynccontextmanager
    async def enter(self, hold_timeout_s: float) -> AsyncIterator[None]:
        """Run a call through the gate, waiting up to ``hold_timeout_s`` while it is paused."""
        if not self._open.is_set():
            try:
                await asyncio.wait_for(self._open.wait(), hold_timeout_s)
            except TimeoutError:
                raise GateClosed(f"gateway paused for more than {hold_timeout_s:g}s") from None
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def pause(self, drain_timeout_s: float, deadline_s: float | None = None) -> bool:
        """Close the gate; True once no call is in flight, False if some still are after the timeout.

        ``deadline_s``: the gate reopens by itself that long after the pause, logged, so a trainer that
        dies between pause and resume cannot hold every harness forever."""
        self._open.clear()
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        if deadline_s is not None:
            self._deadline = asyncio.get_running_loop().call_later(deadline_s, self._expire, deadline_s)
        try:
            await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
        except TimeoutError:
            return False
        return True

    def resume(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._open.set()

    def _expire(self, deadline_s: float) -> None:
        self._deadline = None
        if not self._open.is_set():
            self.auto_resumed += 1
            log.warning("gateway paused for %gs with no resume (did the trainer die mid-sync?): resuming by itself",
                        deadline_s)
            self._open.set()
