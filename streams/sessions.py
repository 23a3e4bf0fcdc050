"""A session's bookkeeping while its calls and finished event come in (pure functions).

polar.calls and polar.session-events are not ordered relative to each other, and calls may arrive out
of order or twice, so a session is only assembled once its finished event *and* all ``num_calls`` calls
are in. The calls themselves are stored under their own keys (delta-encoded, so linear in the
session's tokens); this state only remembers which call indices arrived with which event ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schemas import SessionEvent

from .config import StreamsConfig


@dataclass
class SessionState:
    session_id: str
    partition: int
    first_seen: float
    last_seen: float
    calls: dict[int, str] = field(default_factory=dict)  # call_index -> event_id
    finished: dict[str, Any] | None = None  # the finished SessionEvent, as JSON
    finished_at: float = 0.0
    done: str = ""  # the Trajectory's event id, or "dropped:<reason>"; set once
    done_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        # By hand, not dataclasses.asdict: this runs for every call and asdict deep-copies.
        return {
            "session_id": self.session_id, "partition": self.partition, "first_seen": self.first_seen,
            "last_seen": self.last_seen, "calls": {str(k): v for k, v in self.calls.items()},
            "finished": self.finished, "finished_at": self.finished_at, "done": self.done, "done_at": self.done_at,
        }

    @classmethod
    def from_json(cls, o: dict[str, Any]) -> "SessionState":
        return cls(**{**o, "calls": {int(k): v for k, v in o["calls"].items()}})

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


def add_call(state: SessionState, call_index: int, event_id: str, now: float) -> str:
    """``added``, ``duplicate`` (same event id), ``conflict`` (same call_index, another event: kept
    the first) or ``late`` (the session was already assembled or dropped)."""
    if state.done:
        return "late"
    held = state.calls.get(call_index)
    if held is not None:
        return "duplicate" if held == event_id else "conflict"
    state.calls[call_index] = event_id
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
