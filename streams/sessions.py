"""A session's bookkeeping while its calls and finished event come in (pure functions).

polar.calls and polar.session-events are not ordered relative to each other, and calls may arrive out
of order or twice, so a session is only assembled once its finished event *and* all ``num_calls`` calls
are in. The calls themselves are stored under their own keys (delta-encoded, so linear in the
session's tokens), each with its event id; this state only remembers *which* call indices arrived, as
ranges of indices (one range when the calls come in order), so rewriting it on every call costs a
constant number of bytes, not one entry per call so far.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from schemas import SessionEvent

from .config import StreamsConfig


class CallIndices:
    """A set of call indices kept as sorted, disjoint, non-adjacent half-open ranges ``[start, end)``.

    Calls of a session arrive in order almost always (one partition, published in order), so this is
    one range: the state stays a few bytes however many calls the session has. Adding is idempotent
    (a set), which is what keeps it consistent with the call table after a crash (see session_agent).
    """

    __slots__ = ("ranges", "_len")

    def __init__(self, ranges: list[list[int]] | None = None):
        self.ranges: list[list[int]] = [list(r) for r in ranges or []]
        self._len = sum(e - s for s, e in self.ranges)

    @classmethod
    def of(cls, indices: "Iterator[int] | list[int]") -> "CallIndices":
        out = cls()
        for i in indices:
            out.add(i)
        return out

    def __contains__(self, i: int) -> bool:
        k = bisect_right(self.ranges, [i, float("inf")]) - 1
        return k >= 0 and self.ranges[k][0] <= i < self.ranges[k][1]

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:  # ascending, like sorted() of the old call_index map
        for s, e in self.ranges:
            yield from range(s, e)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CallIndices) and self.ranges == other.ranges

    def __repr__(self) -> str:
        return f"CallIndices({self.ranges})"

    def add(self, i: int) -> bool:
        """Add ``i``; False if it was already in."""
        rs = self.ranges
        k = bisect_right(rs, [i, float("inf")]) - 1  # the last range starting at or before i
        if k >= 0 and i < rs[k][1]:
            return False
        self._len += 1
        joins_left = k >= 0 and rs[k][1] == i
        joins_right = k + 1 < len(rs) and rs[k + 1][0] == i + 1
        if joins_left and joins_right:
            rs[k][1] = rs[k + 1][1]
            del rs[k + 1]
        elif joins_left:
            rs[k][1] = i + 1
        elif joins_right:
            rs[k + 1][0] = i
        else:
            rs.insert(k + 1, [i, i + 1])
        return True

    def to_json(self) -> list[list[int]]:
        return [list(r) for r in self.ranges]


@dataclass
class SessionState:
    session_id: str
    partition: int
    first_seen: float
    last_seen: float
    calls: CallIndices = field(default_factory=CallIndices)  # the call indices held (their data: session-calls)
    finished: dict[str, Any] | None = None  # the finished SessionEvent, as JSON
    finished_at: float = 0.0
    done: str = ""  # the Trajectory's event id, or "dropped:<reason>"; set once
    done_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        # By hand, not dataclasses.asdict: this runs for every call and asdict deep-copies.
        return {
            "session_id": self.session_id, "partition": self.partition, "first_seen": self.first_seen,
            "last_seen": self.last_seen, "calls": self.calls.to_json(),
            "finished": self.finished, "finished_at": self.finished_at, "done": self.done, "done_at": self.done_at,
        }

    @classmethod
    def from_json(cls, o: dict[str, Any]) -> "SessionState":
        calls = o["calls"]
        if isinstance(calls, dict):  # the old form, call_index -> event id: only the indices are kept now
            held = CallIndices.of(sorted(int(k) for k in calls))
        else:
            held = CallIndices(calls)
        return cls(**{**o, "calls": held})

    def finished_event(self) -> SessionEvent | None:
        return None if self.finished is None else SessionEvent.model_validate(self.finished)

    @property
    def missing_calls(self) -> int:
        """Calls still expected (0 when the finished event did not say how many)."""
        expected = (self.finished or {}).get("num_calls")
        return max(0, expected - len(self.calls)) if expected is not None else 0


def new_session(session_id: str, now: float, partition: int) -> SessionState:
    """Empty bookkeeping for a session first seen at ``now`` on ``partition``."""
    return SessionState(session_id, partition, now, now)


def add_call(state: SessionState, call_index: int, event_id: str, now: float,
             held_event_id: Callable[[int], str | None] | None = None) -> str:
    """``added``, ``duplicate`` (same event id), ``conflict`` (same call_index, another event: kept
    the first) or ``late`` (the session was already assembled or dropped).

    The state only knows which indices are in; ``held_event_id(call_index)`` (asked only for an index
    already in) gives the event id stored with that call, or None when its data is not there (lost in a
    crash, see session_agent.on_call): then the call counts as a duplicate that puts its data back.
    Without ``held_event_id`` a held index is always a duplicate.
    """
    if state.done:
        return "late"
    if call_index in state.calls:
        held = None if held_event_id is None else held_event_id(call_index)
        return "duplicate" if held is None or held == event_id else "conflict"
    state.calls.add(call_index)
    state.last_seen = now
    return "added"


def add_finished(state: SessionState, event: SessionEvent, now: float) -> str:
    """Same outcomes as ``add_call``, for the session's finished event."""
    if state.done:
        return "late"
    if state.finished is not None:
        return "duplicate" if state.finished["event_id"] == event.event_id else "conflict"
    state.finished = event.model_dump(mode="json")
    state.finished_at = state.last_seen = now
    return "added"


def due(state: SessionState, config: StreamsConfig, calls_watermark: float = 0.0) -> tuple[str, float]:
    """The session's next action and the time from which it applies: ('assemble', t),
    ('drop:no_finished', t) or ('forget', t); ``t`` is ``-inf`` when it applies at once.

    A finished session with calls still missing (or without num_calls, so stragglers are possible) is
    assembled anyway, masked if calls are missing, once the wait is over: ``missing_calls_grace_s`` has
    passed and this partition's calls have been processed up to ``missing_calls_grace_s`` past the
    finished event (``calls_watermark``: the newest created_at among the calls processed here). The
    gateway publishes a session's calls before its finished event, so by then every call of the session
    that was ever published has been seen; the watermark (not the wall clock) keeps a worker working
    through a backlog, where polar.calls may lag polar.session-events by minutes, from giving up early.
    On an idle partition the watermark stalls, so ``missing_calls_timeout_s`` ends the wait regardless.

    The live agent (``session_agent``) and the replay (``polarstream.tools.rederive``) both ask this
    one function, through ``decide`` at each event and tick, and the replay also to know how far time
    must run at the end of its input; that is what keeps their outputs byte-identical.
    """
    if state.done:
        return "forget", state.done_at + config.done_retention_s
    if state.finished is None:
        return "drop:no_finished", state.last_seen + config.session_expire_s
    expected = state.finished.get("num_calls")
    if expected is not None and len(state.calls) >= expected:
        return "assemble", float("-inf")
    grace = config.missing_calls_grace_s
    at = state.finished_at + config.missing_calls_timeout_s
    if calls_watermark >= state.finished["created_at"] + grace:  # the calls topic is past the grace too
        at = min(at, state.finished_at + grace)
    return "assemble", at


def decide(state: SessionState, now: float, config: StreamsConfig, calls_watermark: float = 0.0) -> str:
    """What to do with a session now: '' (wait), 'assemble', 'drop:no_finished' or 'forget' (see ``due``)."""
    action, at = due(state, config, calls_watermark)
    return action if now >= at else ""
