"""What the viewer knows about one run (one topic prefix), folded in memory from the run's records.

Delivery is at-least-once, so records are deduplicated by ``event_id``. A session keeps its calls by
call_index and its events; a group keeps its latest TrainingGroup; trajectories are kept per session, so
a group page can say why a member was masked. Rewards and pass@k come from polar.trajectories through
the evaluation code of ``polarstream eval`` (tools/evaluate.py), so the two never disagree.

``seq`` counts the changes: the pages' live updates poll it and re-render only when it moved. The
reader thread feeds the index while the server renders from it, hence the lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from schemas import (RECORD_BY_TOPIC, CallRecorded, Parts, PolicyVersion, RecordDecodeError, SessionEvent, TrainingGroup,
                     Trajectory, decode)

from ..tools.evaluate import Latest, evaluate

# The topics the viewer reads (logical names; the prefix is the run's).
TOPICS = ("calls", "session-events", "trajectories", "groups", "policy")
PASS_KS = (1, 2, 4, 8)  # pass@k columns; a k larger than a task's samples shows as "-"


@dataclass
class SessionView:
    """One session: its calls by call_index and its lifecycle events, as recorded."""

    session_id: str
    group_id: str = ""
    task_id: str = ""
    sample_index: int = 0
    harness: str = ""
    calls: dict[int, CallRecorded] = field(default_factory=dict)
    events: list[SessionEvent] = field(default_factory=list)

    @property
    def finished(self) -> SessionEvent | None:
        return next((e for e in reversed(self.events) if e.kind == "finished"), None)

    @property
    def status(self) -> str:
        """The finished status, else the latest event kind ("started", ...), else "recording"."""
        done = self.finished
        if done is not None:
            return done.status or "finished"
        return self.events[-1].kind if self.events else "recording"

    @property
    def reward(self) -> float | None:
        return next((e.reward for e in reversed(self.events) if e.reward is not None), None)


class RunIndex:
    """The records of one topic prefix, indexed for the pages."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.sessions: dict[str, SessionView] = {}
        self.groups: dict[str, TrainingGroup] = {}
        self.parts = Parts()
        self.trajectories: dict[str, Trajectory] = {}  # session_id -> its trajectory (latest read)
        self.samples = Latest()  # one evaluation sample per (group, sample_index)
        self.rewards: list[tuple[float, float]] = []  # (created_at, reward) per trajectory, in arrival order
        self.policies: dict[int, PolicyVersion] = {}
        self.seq = 0
        self.undecodable = 0
        self.caught_up = False  # the reader reached the ends the topics had at start
        self.error = ""  # why the reader cannot read (shown on the runs page)
        self.lock = threading.RLock()
        self._seen: set[str] = set()

    def feed(self, topic: str, value: bytes) -> bool:
        """Take one message of logical ``topic``; True when it changed the index."""
        try:
            record = decode(value, RECORD_BY_TOPIC[topic])
        except RecordDecodeError:
            self.undecodable += 1  # a foreign or broken message must not stop the viewer
            return False
        with self.lock:
            if record.event_id in self._seen:
                return False
            self._seen.add(record.event_id)
            if isinstance(record, CallRecorded):
                self._call(record)
            elif isinstance(record, SessionEvent):
                self._event(record)
            elif isinstance(record, Trajectory):
                whole = self.parts.add(record)  # shown once all parts of one sent in parts are in
                if whole is not None:
                    self._trajectory(whole)
            elif isinstance(record, TrainingGroup):
                whole = self.parts.add(record)  # shown once all parts of a group sent in parts are in
                if whole is not None:
                    self.groups[whole.group_id] = whole
            elif isinstance(record, PolicyVersion):
                self.policies[record.version] = record
            self.seq += 1
        return True

    def session(self, session_id: str) -> SessionView:
        s = self.sessions.get(session_id)
        if s is None:
            s = self.sessions[session_id] = SessionView(session_id)
        return s

    def _call(self, call: CallRecorded) -> None:
        s = self.session(call.session_id)
        s.group_id, s.task_id, s.sample_index = call.group_id or s.group_id, call.task_id or s.task_id, call.sample_index
        s.harness = call.harness or s.harness
        s.calls.setdefault(call.call_index, call)  # the first copy of a call_index wins, as in the streams

    def _event(self, ev: SessionEvent) -> None:
        s = self.session(ev.session_id)
        s.group_id, s.task_id, s.sample_index = ev.group_id or s.group_id, ev.task_id or s.task_id, ev.sample_index
        s.harness = ev.harness or s.harness
        s.events.append(ev)

    def _trajectory(self, t: Trajectory) -> None:
        self.trajectories[t.session_id] = t
        if self.samples.add(t) and t.status in ("ok", "timeout"):
            self.rewards.append((t.created_at, t.reward))

    # -- questions the pages ask ----------------------------------------------------------------

    def group_sessions(self, group_id: str) -> list[SessionView]:
        """The sessions recorded for ``group_id``, by sample index."""
        return sorted((s for s in self.sessions.values() if s.group_id == group_id), key=lambda s: s.sample_index)

    def group_ids(self) -> list[str]:
        """Every group seen (emitted or still collecting), oldest first."""
        first: dict[str, float] = {}
        for s in self.sessions.values():
            if s.group_id:
                t = min([c.created_at for c in s.calls.values()] + [e.created_at for e in s.events], default=0.0)
                first[s.group_id] = min(first.get(s.group_id, t), t)
        for g in self.groups.values():
            first.setdefault(g.group_id, g.created_at)
        return sorted(first, key=lambda g: (first[g], g))

    def masked_reason(self, session_id: str) -> str:
        """Why a session was left out of its group: the group's own reason where it gives one (a judge
        failure's class), else from its trajectory, else its finished event."""
        t = self.trajectories.get(session_id)
        s = self.sessions.get(session_id)
        g = self.groups.get(t.group_id if t is not None else s.group_id if s is not None else "")
        if g is not None and session_id in g.masked_reasons:
            return g.masked_reasons[session_id]
        if t is not None:
            why = [k.removeprefix("masked.") for k in t.metrics if k.startswith("masked.")]
            detail = ", ".join(sorted(why)) or ("unusable" if not t.usable else "")
            return f"status {t.status}" + (f": {detail}" if detail else "")
        done = s.finished if s else None
        if done is not None:
            return f"status {done.status}" + (f": {done.detail}" if done.detail else "")
        return "no trajectory or finished event read"

    def cells(self) -> list[dict]:
        """Evaluation per harness x policy version x task set: samples, mean reward, pass@k."""
        return evaluate(self.samples.samples.values(), PASS_KS)
