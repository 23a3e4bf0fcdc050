"""Both stream stages in one process, driven by recorded events and event time (no Kafka, no Faust).

The live workers (``streams/session_agent.py``, ``streams/group_agent.py``) keep their state in Faust
tables and decide on wall-clock ticks. This module keeps the same state in dicts and calls the same
pure functions in the same order, with time taken from the events themselves:

    calls / finished events ─▶ sessions.add_call|add_finished ─▶ sessions.decide ─▶ build_trajectory
    trajectories ─▶ groups.add_member ─▶ groups.decide ─▶ build_group

so a replay of a run with the live worker's settings yields the live records byte for byte, and the
same input always yields the same output. ``now`` is the broker timestamp of the event being handled
(the live worker used its wall clock, which is within moments of it); deadline sweeps run every
``tick_interval_s`` of event time, like the live ticks, and, like a live worker working through a
backlog, a finished session waits for missing calls until the calls processed in its partition are
``missing_calls_grace_s`` newer than its finished event. ``drain()`` ends the input: every deadline is
taken as passed, so finished sessions still missing calls are assembled (and masked), sessions that
never finished are dropped, and groups emit if they have ``min_valid`` usable members.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import orjson

from schemas import CallRecorded, Record, SessionEvent, Trajectory, decode, encode
from streams import groups as group_fns
from streams import sessions as session_fns
from streams.assembly import CallTokens
from streams.config import StreamsConfig
from streams.groups import GroupState, build_group
from streams.sessions import SessionState
from streams.trajectory import build_trajectory

log = logging.getLogger(__name__)

_BATCH_OVERHEAD = 4096  # as the live runtime: a record batch carries framing around the record


@dataclass(frozen=True)
class Limits:
    """Largest record each output topic takes (its max.message.bytes)."""

    trajectory_bytes: int
    group_bytes: int


class Rederiver:
    """Feed it calls and session events in order; it returns the Trajectories and TrainingGroups the
    live stream processors would have emitted at that point."""

    def __init__(self, config: StreamsConfig, limits: Limits):
        self.config, self.limits = config, limits
        self.counters: Counter = Counter()
        self.sessions: dict[str, SessionState] = {}
        self.calls: dict[str, dict[int, CallTokens]] = {}  # calls of sessions not yet assembled
        self.groups: dict[str, GroupState] = {}
        self.members: dict[str, dict[int, bytes]] = {}  # group -> sample_index -> Trajectory bytes
        self.clock = float("-inf")
        self._next_sweep = float("-inf")
        self._hold_groups = False
        # Per calls partition, the newest call time processed so far (``calls_seen_until`` of the live
        # worker, which a replay always is: a worker working through a backlog until its input ends).
        self.calls_watermark: dict[int, float] = {}

    # ------------------------------------------------------------------ inputs

    def on_call(self, call: CallRecorded, now: float, partition: int = 0) -> list[Record]:
        """A recorded call (deduplicated; a session completed by it is assembled)."""
        self.calls_watermark[partition] = max(self.calls_watermark.get(partition, 0.0), call.created_at)
        out = self._tick(now)
        tokens = CallTokens.from_record(call)
        if len(orjson.dumps(tokens.to_json())) > self.config.max_record_bytes:
            self.counters["calls.oversized"] += 1  # the live worker cannot keep it in state either
            return out
        state = self.sessions.get(call.session_id) or session_fns.new_session(call.session_id, self.clock, partition)
        outcome = session_fns.add_call(state, call.call_index, call.event_id, self.clock)
        self.counters[f"calls.{outcome}"] += 1
        if outcome == "added":
            self.calls.setdefault(call.session_id, {})[call.call_index] = tokens
            self.sessions[call.session_id] = state
        if outcome in ("added", "duplicate"):  # the live agent re-decides on a duplicate too
            out += self._advance_session(state)
        return out

    def on_session_event(self, event: SessionEvent, now: float, partition: int = 0) -> list[Record]:
        """A session event: ``finished`` may complete a session; other kinds are counted and skipped."""
        out = self._tick(now)
        if event.kind != "finished":
            self.counters[f"session_events.{event.kind}.ignored"] += 1
            return out
        state = self.sessions.get(event.session_id) or session_fns.new_session(event.session_id, self.clock, partition)
        outcome = session_fns.add_finished(state, event, self.clock)
        self.counters[f"finished.{outcome}"] += 1
        if outcome == "added":
            self.sessions[event.session_id] = state
            out += self._advance_session(state)
        return out

    def drain(self) -> list[Record]:
        """End of input: act as if every deadline passed (see the module doc)."""
        cfg = self.config
        horizon = 1.0 + max(cfg.group_deadline_s, cfg.group_expire_s, cfg.missing_calls_grace_s,
                            cfg.session_expire_s, cfg.done_retention_s)
        # Input time is the broker's clock, the missing-calls grace also counts on the records' own
        # created_at: start past both.
        finished_at = max((s.finished["created_at"] for s in self.sessions.values() if s.finished), default=0.0)
        start = max(self.clock, finished_at, *self.calls_watermark.values(), 0.0)
        # Every session settles before any group decides (the live sessions' grace is far shorter
        # than a group's deadline), then one more horizon passes for the groups that opened meanwhile.
        self.clock = start + horizon
        self._hold_groups = True
        try:
            out = [r for state in list(self.sessions.values()) for r in self._advance_session(state, self.clock)]
        finally:
            self._hold_groups = False
        # Per calls partition, the newest call time processed so far (``calls_seen_until`` of the live
        # worker, which a replay always is: a worker working through a backlog until its input ends).
        self.calls_watermark: dict[int, float] = {}
        return out + self.sweep(start + 2 * horizon)

    def sweep(self, now: float) -> list[Record]:
        """A deadline sweep of every session and group at ``now`` (the live ticks)."""
        self.clock = max(self.clock, now)
        out: list[Record] = []
        for state in list(self.sessions.values()):
            out += self._advance_session(state, self.calls_watermark.get(state.partition, 0.0))
        for gid, state in list(self.groups.items()):
            if state.emitted:
                if self.clock - state.closed_at >= self.config.done_retention_s:
                    del self.groups[gid]
                continue
            out += self._advance_group(state)
        return out

    def pending(self) -> dict[str, int]:
        """What is still waiting for input (after ``drain`` only what could never complete)."""
        return {
            "sessions_open": sum(1 for s in self.sessions.values() if not s.done),
            "groups_open": sum(1 for g in self.groups.values() if not g.emitted),
        }

    # ------------------------------------------------------------------ stages

    def _tick(self, now: float) -> list[Record]:
        self.clock = max(self.clock, now)
        if self.clock < self._next_sweep:
            return []
        self._next_sweep = self.clock + self.config.tick_interval_s
        return self.sweep(self.clock)

    def _advance_session(self, state: SessionState, seen_until: float = 0.0) -> list[Record]:
        action = session_fns.decide(state, self.clock, self.config, seen_until)
        if not action:
            return []
        sid = state.session_id
        if action == "forget":
            del self.sessions[sid]
            return []
        out: list[Record] = []
        held = self.calls.pop(sid, {})
        if action == "assemble":
            finished = state.finished_event()
            assert finished is not None
            calls = [held[i] for i in sorted(state.calls) if i in held]
            missing = state.missing_calls + (len(state.calls) - len(calls))
            self.counters["sessions.missing_calls"] += bool(missing)
            traj = build_trajectory(finished, calls, self.config, missing_calls=missing)
            data = encode(traj)
            if len(data) > self.limits.trajectory_bytes - _BATCH_OVERHEAD:
                self.counters["trajectories.oversized"] += 1
                state.done = "dropped:oversized"
            else:
                state.done = traj.event_id
                self.counters["sessions.assembled"] += 1
                out += [traj, *self._on_trajectory(traj, data)]
        else:  # drop:no_finished
            self.counters["sessions.dropped_no_finished"] += 1
            state.done = action
        state.done_at = self.clock
        return out

    def _on_trajectory(self, traj: Trajectory, data: bytes) -> list[Record]:
        state = self.groups.get(traj.group_id) or group_fns.new_group(traj, self.clock, 0)
        self.groups[traj.group_id] = state
        outcome = group_fns.add_member(state, traj)
        self.counters[f"members.{outcome}"] += 1
        if outcome not in ("added", "replaced", "duplicate"):
            return []
        if outcome != "duplicate":
            # Kept as bytes and decoded when the group is built, exactly as the live stage does.
            self.members.setdefault(traj.group_id, {})[traj.sample_index] = data
        return [] if self._hold_groups else self._advance_group(state)

    def _advance_group(self, state: GroupState) -> list[Record]:
        action = group_fns.decide(state, self.clock, self.config)
        if not action:
            return []
        gid = state.group_id
        stored = self.members.pop(gid, {})
        out: list[Record] = []
        if action == "emit":
            members = [decode(stored[i], Trajectory) for i in sorted(state.members)]
            group = build_group(gid, members, self.config)
            if group is None:
                self.counters["groups.dropped_zero_variance"] += 1
                state.emitted = "dropped:zero_variance"
            elif len(encode(group)) > self.limits.group_bytes - _BATCH_OVERHEAD:
                self.counters["groups.oversized"] += 1
                state.emitted = "dropped:oversized"
            else:
                state.emitted = group.event_id
                out.append(group)
        else:
            self.counters[f"groups.{action.replace(':', '_')}"] += 1
            state.emitted = action
        state.closed_at = self.clock
        return out
