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
``missing_calls_grace_s`` newer than its finished event (or ``missing_calls_timeout_s`` passed).
``drain()`` ends the input the way a live worker sees its input stop: the calls watermark stalls and
time runs on from deadline to deadline (``sessions.due`` / ``groups.due``, the same functions the live
``decide`` uses) until nothing is open: finished sessions still missing calls are assembled (masked)
at their timeout, sessions that never finished are dropped, groups emit at their deadline with the
members in by then, and a member assembled after its group emitted is late, exactly as live.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from schemas import CallRecorded, Record, SessionEvent, Trajectory, decode, encode, join_parts
from streams import groups as group_fns
from streams import sessions as session_fns
from streams.assembly import CallTokens
from streams.config import StreamsConfig
from streams.groups import GroupState, build_group
from streams.judge import Judged, drop_reason, process_advantages
from streams.runtime import split_counted
from streams.sessions import SessionState
from streams.trajectory import build_trajectory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """Largest record each output topic takes (its max.message.bytes)."""

    trajectory_bytes: int
    group_bytes: int


class Rederiver:
    """Feed it calls and session events in order; it returns the Trajectories and TrainingGroups the
    live stream processors would have emitted at that point."""

    def __init__(self, config: StreamsConfig, limits: Limits, *, packed: bool = True,
                 judge: Callable[[list[Trajectory]], Judged] | None = None):
        self.config, self.limits = config, limits
        self.judge = judge  # members -> their judged rewards (a replay's judge stage); None: outcome rewards
        self.packed = packed  # the encoding the outputs are written in (Settings.record_format): parts split by it
        self.counters: Counter = Counter()
        self.sessions: dict[str, SessionState] = {}
        self.calls: dict[str, dict[int, CallTokens]] = {}  # calls of sessions not yet assembled
        self.groups: dict[str, GroupState] = {}
        self.members: dict[str, dict[int, bytes]] = {}  # group -> sample_index -> Trajectory bytes
        self.gathering: dict[tuple[str, int, str], dict[int, Trajectory]] = {}  # parts of a split trajectory
        self.clock = float("-inf")
        self._next_sweep = float("-inf")
        # Per calls partition, the newest call time processed so far (``Runtime.calls_watermark`` of the live
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
        held = self.calls.get(call.session_id, {})
        outcome = session_fns.add_call(state, call.call_index, call.event_id, self.clock,
                                       lambda i: held[i].event_id if i in held else None)
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
        """End of input: time runs on with no new input until every session and group is closed
        (see the module doc). Each sweep lands on the earliest deadline still ahead, so sessions and
        groups close in the order a live worker's ticks would close them."""
        out: list[Record] = []
        while True:
            due = [session_fns.due(s, self.config, self._watermark(s))[1] for s in self.sessions.values() if not s.done]
            due += [group_fns.due(g, self.config)[1] for g in self.groups.values() if not g.emitted]
            if not due:
                return out
            out += self.sweep(max(self.clock, min(due)))

    def sweep(self, now: float) -> list[Record]:
        """A deadline sweep of every session and group at ``now`` (the live ticks)."""
        self.clock = max(self.clock, now)
        out: list[Record] = []
        for state in list(self.sessions.values()):
            out += self._advance_session(state)
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

    def _watermark(self, state: SessionState) -> float:
        return self.calls_watermark.get(state.partition, 0.0)

    def _advance_session(self, state: SessionState) -> list[Record]:
        action = session_fns.decide(state, self.clock, self.config, self._watermark(state))
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
            records = self._split("trajectories", traj, self.limits.trajectory_bytes)
            if records is None:
                state.done = "dropped:oversized"
            else:
                state.done = traj.event_id
                self.counters["sessions.assembled"] += 1
                for part, data in records:
                    out += [part, *self._on_trajectory(part, data)]
        else:  # drop:no_finished
            self.counters["sessions.dropped_no_finished"] += 1
            state.done = action
        state.done_at = self.clock
        return out

    def _split(self, topic: str, record, limit: int) -> list[tuple[Any, bytes]] | None:
        """As the live Runtime.send_split: the record, or its parts when past the limit; None when oversized."""
        return split_counted(topic, record, limit, lambda name, n: self.counters.update({name: n}), packed=self.packed)

    def _on_trajectory(self, traj: Trajectory, data: bytes) -> list[Record]:
        if traj.parts > 1:  # as the live stage: the member is in once all its parts are
            held = self.gathering.setdefault((traj.group_id, traj.sample_index, traj.part_of), {})
            held[traj.part] = traj
            if len(held) < traj.parts:
                self.counters["members.parts_held"] += 1
                return []
            del self.gathering[(traj.group_id, traj.sample_index, traj.part_of)]
            traj = join_parts(list(held.values()))
            data = encode(traj, packed=self.packed)
        state = self.groups.get(traj.group_id) or group_fns.new_group(traj, self.clock, 0)
        self.groups[traj.group_id] = state
        outcome = group_fns.add_member(state, traj)
        self.counters[f"members.{outcome}"] += 1
        if outcome not in ("added", "replaced", "duplicate"):
            return []
        if outcome != "duplicate":
            # Kept as bytes and decoded when the group is built, exactly as the live stage does.
            self.members.setdefault(traj.group_id, {})[traj.sample_index] = data
        return self._advance_group(state)

    def _advance_group(self, state: GroupState) -> list[Record]:
        action = group_fns.decide(state, self.clock, self.config)
        if not action:
            return []
        gid = state.group_id
        stored = self.members.pop(gid, {})
        out: list[Record] = []
        if action == "emit":
            members = [decode(stored[i], Trajectory) for i in sorted(state.members)]
            masked_reasons: dict[str, str] = {}
            if self.judge is not None:  # as the live group stage (group_agent.advance)
                judged = self.judge(members)
                members, masked_reasons = judged.members, judged.masked
                if reason := drop_reason(judged, state.min_valid):
                    self.counters["groups.dropped_judge"] += 1
                    state.emitted, state.closed_at = f"dropped:{reason}", self.clock
                    return out
            group = build_group(gid, members, self.config, masked_reasons)
            if group is not None and self.judge is not None and judged.call_scores:
                group = process_advantages(group, judged.call_scores, self.config.judge.process_weight)
            if group is None:
                self.counters["groups.dropped_zero_variance"] += 1
                state.emitted = "dropped:zero_variance"
            elif (records := self._split("groups", group, self.limits.group_bytes)) is None:
                state.emitted = "dropped:oversized"
            else:
                state.emitted = group.event_id
                out += [part for part, _ in records]
        else:
            self.counters[f"groups.{action.replace(':', '_')}"] += 1
            state.emitted = action
        state.closed_at = self.clock
        return out
