"""Stage 1: calls + session events -> one Trajectory per finished session, keyed by group.

One agent reads polar.calls, polar.session-events and this stage's tick topic together (all keyed by
session and co-partitioned), so a session's events are handled one at a time by one worker. State:

- ``sessions``: session_id -> SessionState (which call indices arrived, as ranges: a constant size per
  session however many calls it has, so rewriting it on each call is O(1); the finished event; done
  marker)
- ``session-calls``: "<session_id>/<call_index>" -> where the call sits on polar.calls, with its event id
  (which tells a duplicate from a conflict). Its token data is cached in memory as it arrives and read
  back from polar.calls on a miss (streams/source_log.py): the changelog carries no second copy of
  every token. (Values written before that are the data itself, CallTokens JSON, and still read.)

Deadlines (assemble a session still missing calls, drop one that never finished, forget a done marker)
are kept in memory per partition (streams/deadlines.py): a tick touches only the sessions that are due.

Order of effects, for crash safety under at-least-once: store the input; when the session is complete,
send its trajectory (in parts when it is past the topic's limit, schemas/parts.py); once the broker
acknowledged it, every part (applied by a later event of the partition, see Runtime.settle), mark the
session done, then delete its calls. A crash in between replays inputs into
a state that may already hold them (deduplicated) and, at worst, re-sends a byte-identical trajectory
that readers drop by event_id.
"""

from __future__ import annotations

import logging
import time

import orjson

from schemas import CallRecorded, SessionEvent, is_packed

from .assembly import CallTokens
from .deadlines import Wakeups
from .runtime import Runtime
from .source_log import Recent, ref
from .sessions import SessionState, add_call, add_finished, decide, due, new_session
from .trajectory import build_trajectory

log = logging.getLogger("streams.sessions")

SESSIONS, CALLS = "sessions", "session-calls"
STAGE = "sessions"


def register(rt: Runtime) -> None:
    """Declare the stage's agent on the app."""
    topo = rt.topo

    async def handle(topic: str, value: bytes, partition: int, offset: int) -> None:
        if topic == topo.session_ticks:
            await on_tick(rt, partition)
        elif topic == topo.calls:
            await on_call(rt, value, partition, offset)
        else:
            await on_session_event(rt, value, partition, offset)

    rt.agent(STAGE, [topo.calls, topo.session_events], topo.session_ticks, handle)


def _recent(rt: Runtime) -> Recent[CallTokens]:
    """The token data of the calls seen lately, by table key, as decoded (no re-encoding on arrival nor
    parsing to assemble), counted at their size in memory."""
    return rt.cache(CALLS, rt.config.call_cache_bytes)


def _load(rt: Runtime, session_id: str) -> SessionState | None:
    raw = rt.get(SESSIONS, session_id)
    return None if raw is None else SessionState.from_json(raw)


async def on_call(rt: Runtime, value: bytes, partition: int, offset: int) -> None:
    """Store one call (deduplicated) and assemble its session if that completed it."""
    call = rt.decode(value, CallRecorded, rt.topo.calls, partition, offset)
    if call is None:
        return
    rt.calls_watermark[partition] = max(rt.calls_watermark.get(partition, 0.0), call.created_at)
    now = time.time()
    loaded = _load(rt, call.session_id)
    state = loaded or new_session(call.session_id, now, partition)
    tokens = CallTokens.from_record(call)
    # Bounded by the size of its compact JSON (what state once held, and what the replay checks); that is
    # smaller than the JSON record it came from, and at most 4x a packed one (an id or a logprob is at
    # most 16 characters for 4 bytes), so only a record that could be past the limit is encoded to see.
    if len(value) * (4 if is_packed(value) else 1) > rt.config.max_record_bytes and len(data := orjson.dumps(tokens.to_json())) > rt.config.max_record_bytes:
        # Cannot be kept in state; the session will assemble without it (masked as missing calls).
        rt.count("calls.oversized")
        log.error("call %s of session %s is %d bytes of tokens, over max_record_bytes: left out",
                  call.call_index, call.session_id, len(data))
        return
    key = f"{call.session_id}/{call.call_index}"
    stored = rt.get(CALLS, key)
    outcome = add_call(state, call.call_index, call.event_id, now, lambda _: None if stored is None else stored["e"])
    rt.count(f"calls.{outcome}")
    if outcome == "conflict":
        log.warning("session %s call %s: a second, different event %s; kept the first",
                    call.session_id, call.call_index, call.event_id)
    if outcome not in ("added", "duplicate"):
        return
    # The two tables' changelogs are written independently, so after a crash one can be ahead of the
    # other; the replay of the call (not committed, hence re-delivered) reconciles them. The state may
    # list a call whose reference was lost: the duplicate puts it back. The reference may be there while
    # the state does not list it: the call is added again (a set, so nothing counts twice). Either way
    # the session assembles from exactly the calls the state lists.
    if stored is None or stored["e"] != call.event_id:
        rt.put(CALLS, key, ref(call.event_id, partition, offset))
        if outcome == "duplicate":
            rt.count("calls.restored")
    _recent(rt).put(key, call.event_id, tokens, tokens.held_bytes())
    if outcome == "added" or loaded is None:
        _save(rt, state)
    await advance(rt, state, now)


async def on_session_event(rt: Runtime, value: bytes, partition: int, offset: int) -> None:
    """Record a session's finished event (other kinds are counted and skipped)."""
    event = rt.decode(value, SessionEvent, rt.topo.session_events, partition, offset)
    if event is None:
        return
    if event.kind != "finished":
        rt.count(f"session_events.{event.kind}.ignored")
        return
    now = time.time()
    state = _load(rt, event.session_id) or new_session(event.session_id, now, partition)
    outcome = add_finished(state, event, now)
    rt.count(f"finished.{outcome}")
    if outcome != "added":
        return
    _save(rt, state)
    await advance(rt, state, now)


async def on_tick(rt: Runtime, partition: int) -> None:
    """Deadlines of this partition's sessions: assemble stragglers, drop orphans, forget old markers.

    Only the sessions whose wake-up time has come are read (``_wakeups``); each is re-decided from its
    stored state and scheduled again."""
    now = time.time()
    by_time, by_watermark = _wakeups(rt)
    for sid in by_watermark.pop_due(partition, rt.calls_watermark.get(partition, 0.0)):
        state = _load(rt, sid)
        if state is not None:
            _schedule(rt, state)  # the calls watermark passed its grace: its deadline moved earlier
    for sid in by_time.pop_due(partition, now):
        state = _load(rt, sid)
        if state is not None:
            await advance(rt, state, now)


def _wakeups(rt: Runtime) -> tuple[Wakeups, Wakeups]:
    """This stage's wake-ups (on the wall clock, and on each partition's calls watermark), built from
    the sessions table after each rebalance."""
    return rt.index(STAGE, lambda: _rebuild_wakeups(rt))


def _rebuild_wakeups(rt: Runtime) -> tuple[Wakeups, Wakeups]:
    wakeups = Wakeups(), Wakeups()
    for raw in list(rt.tables[SESSIONS].values()):
        _schedule_into(rt, SessionState.from_json(orjson.loads(raw)), *wakeups)
    return wakeups


def _schedule(rt: Runtime, state: SessionState) -> None:
    _schedule_into(rt, state, *_wakeups(rt))


def _schedule_into(rt: Runtime, state: SessionState, by_time: Wakeups, by_watermark: Wakeups) -> None:
    """Wake the session by its deadline (``sessions.due``), and when the partition's calls watermark can
    bring that deadline forward (a finished session missing calls), also when the watermark gets there."""
    config, partition = rt.config, state.partition
    watermark = rt.calls_watermark.get(partition, 0.0)
    action, at = due(state, config, watermark)
    by_time.wake_by(partition, state.session_id, at)
    if action == "assemble" and state.finished is not None and at > float("-inf"):
        threshold = state.finished["created_at"] + config.missing_calls_grace_s
        if watermark < threshold and state.finished_at + config.missing_calls_grace_s < at:
            by_watermark.wake_by(partition, state.session_id, threshold)


def _save(rt: Runtime, state: SessionState) -> None:
    rt.put(SESSIONS, state.session_id, state.to_json())
    _schedule(rt, state)


async def advance(rt: Runtime, state: SessionState, now: float) -> None:
    """Act on what ``decide`` says for this session now.

    Effects go in crash-safe order: the session is marked done only once its trajectory is acknowledged
    (see Runtime.settle), and the done marker is written before the calls are deleted, so no crash can
    leave a session that is neither done nor assemblable.
    """
    sid = state.session_id
    if rt.is_pending(STAGE, sid):
        _schedule(rt, state)  # looked at again at the next tick of the partition
        return  # its trajectory is on the way; settling will mark it done
    action = decide(state, now, rt.config, rt.calls_watermark.get(state.partition, 0.0))
    if not action:
        _schedule(rt, state)
        return
    if action == "forget":
        _delete_calls(rt, state)  # leftovers of a crash between the done marker and the deletes
        rt.delete(SESSIONS, sid)
        _wakeups(rt)[0].discard(sid)
        _wakeups(rt)[1].discard(sid)
        return
    if action == "assemble":
        stored = await _stored_calls(rt, state)
        if stored is None:
            _schedule(rt, state)  # due at once: retried at every tick until the data is back
            return  # a call's reference is still being replayed after a restart, or the broker is slow
        calls, gone = stored
        traj = _build(rt, state, calls, gone)
        fut = await rt.send_split("trajectories", traj, rt.topo.trajectory_max_bytes)  # in parts when past the limit
        if fut is None:
            _close(rt, state, "dropped:oversized", now)
        else:
            rt.count("sessions.assembled")
            rt.pend(STAGE, sid, state.partition, fut, lambda: _close(rt, _load(rt, sid) or state, traj.event_id, now))
            _schedule(rt, state)
        return
    rt.count("sessions.dropped_no_finished")
    log.warning("session %s: %d calls but no finished event after %.0fs: dropped",
                sid, len(state.calls), rt.config.session_expire_s)
    _close(rt, state, action, now)


def _close(rt: Runtime, state: SessionState, done: str, now: float) -> None:
    state.done, state.done_at = done, now
    _save(rt, state)
    _delete_calls(rt, state)


def _delete_calls(rt: Runtime, state: SessionState) -> None:
    recent = _recent(rt)
    for idx in state.calls:
        rt.delete(CALLS, f"{state.session_id}/{idx}")
        recent.pop(f"{state.session_id}/{idx}")


async def _stored_calls(rt: Runtime, state: SessionState) -> tuple[list[CallTokens], int] | None:
    """The calls the state lists (ascending), and how many of them are gone from polar.calls; None
    while a reference is missing (replayed after a restart) or the broker did not answer."""
    found: dict[int, CallTokens] = {}
    refs: dict[int, dict] = {}  # call index -> reference, for the calls not in the cache
    recent = _recent(rt)
    for idx in state.calls:
        key = f"{state.session_id}/{idx}"
        held = rt.get(CALLS, key)
        if held is None:
            rt.count("sessions.awaiting_replayed_call")
            return None
        if "at" not in held:  # written before references: the data itself
            found[idx] = CallTokens.from_json(held)
            continue
        tokens = recent.get(key, held["e"])
        if tokens is None:
            refs[idx] = held
        else:
            found[idx] = tokens  # folding reads a call's lists, never changes them
    read = await rt.read_back(rt.topo.calls, CallRecorded, refs, "calls") if refs else {}
    if read is None:
        return None
    found.update((i, CallTokens.from_record(call)) for i, call in read.items())
    return [found[i] for i in sorted(found)], len(refs) - len(read)  # a gone call masks its session


def _build(rt: Runtime, state: SessionState, calls: list[CallTokens], gone: int = 0):
    finished = state.finished_event()
    assert finished is not None
    missing = state.missing_calls + gone
    if missing:
        rt.count("sessions.missing_calls")
        log.warning("session %s assembled with %d calls missing: masked out of its group", state.session_id, missing)
    traj = build_trajectory(finished, calls, rt.config, missing_calls=missing)
    for reason, n in traj.stats.items():
        if reason.startswith("break."):
            rt.count(reason, int(n))
    return traj
