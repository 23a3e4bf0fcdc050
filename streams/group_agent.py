"""Stage 2: trajectories -> one TrainingGroup per group, with advantages.

Reads polar.trajectories (keyed by group) and this stage's tick topic. State:

- ``groups``: group_id -> GroupState (one reference per sample, emitted marker)
- ``group-members``: "<group_id>/<sample_index>" -> where the member sits on polar.trajectories, with
  its event id (values written before references are the member's bytes, and still read); for a
  member sent in parts (schemas/parts.py), the whole one's event id and its parts' references, which
  "<group_id>/<sample_index>/<whole event id>" gathers until the last part is in

The members decoded on arrival are kept in memory (bounded), so emitting a group neither decodes them
again (that was a tenth of the worker's CPU) nor reads them back; a miss reads the member from
polar.trajectories (streams/source_log.py). Members this worker's session stage sent come with the
bytes they were sent as, and the group writes those bytes instead of encoding the member again.

Deadlines (emit or drop at the group's deadline, forget the emitted marker) are kept in memory per
partition (streams/deadlines.py): a tick touches only the groups that are due.

A group emits once: the TrainingGroup is sent and acknowledged before the emitted marker is written,
so a crash can only cause a byte-identical re-send (same inputs, same deterministic id), never a loss.
"""

from __future__ import annotations

import logging
import time

import orjson

from schemas import Trajectory, decode, join_parts

from . import metrics
from .deadlines import Wakeups
from .groups import GroupState, add_member, build_group, decide, due, new_group
from .judge import drop_reason, process_advantages
from .runtime import Runtime
from .source_log import Recent, ref, reference

log = logging.getLogger("streams.groups")

GROUPS, MEMBERS = "groups", "group-members"
STAGE = "groups"


def register(rt: Runtime) -> None:
    """Declare the stage's agent on the app."""
    topo = rt.topo

    async def handle(topic: str, value: bytes, partition: int, offset: int) -> None:
        if topic == topo.group_ticks:
            await on_tick(rt, partition)
        else:
            await on_trajectory(rt, value, partition, offset)

    rt.agent(STAGE, [topo.trajectories], topo.group_ticks, handle)


def _decoded(rt: Runtime) -> Recent[tuple[Trajectory, bytes | None]]:
    """Members decoded on arrival, by table key, counted at their encoded size; with their bytes when
    this worker sent them whole, which their group writes instead of encoding them again."""
    return rt.cache(MEMBERS, rt.config.member_cache_bytes)


def _load(rt: Runtime, group_id: str) -> GroupState | None:
    raw = rt.get(GROUPS, group_id)
    return None if raw is None else GroupState.from_json(raw)


async def on_trajectory(rt: Runtime, value: bytes, partition: int, offset: int) -> None:
    """Add a trajectory to its group (deduplicated; retries replace) and emit the group when ready."""
    handed = rt.handed_over(partition, offset)  # sent by this worker's session stage: not decoded again
    if handed is None:
        traj = rt.decode(value, Trajectory, rt.topo.trajectories, partition, offset)
        if traj is None:
            return
    else:
        traj = handed[0]
        rt.count("trajectories.handed_over")
    key = f"{traj.group_id}/{traj.sample_index}"
    if traj.parts > 1:  # a part of a trajectory sent in parts: the member is in once all its parts are
        gathered = _gather(rt, key, traj, len(value), partition, offset)
        if gathered is None:
            return
        traj, member_ref, size, gathering = gathered
    else:
        member_ref, size, gathering = ref(traj.event_id, partition, offset), len(value), ""
    now = time.time()
    state = _load(rt, traj.group_id) or new_group(traj, now, partition)
    outcome = add_member(state, traj)
    rt.count(f"members.{outcome}")
    if outcome == "conflict":
        log.warning("group %s sample %d attempt %d: a second, different trajectory %s; kept the first",
                    traj.group_id, traj.sample_index, traj.attempt, traj.event_id)
    if outcome in ("added", "replaced", "duplicate"):
        # As in the session stage: after a crash the state can be ahead of the members table, and the
        # replayed trajectory puts its reference back.
        stored = rt.get(MEMBERS, key)
        if stored is None or stored.get("e", stored.get("event_id")) != traj.event_id:
            rt.put(MEMBERS, key, member_ref)
            if outcome == "duplicate":
                rt.count("members.restored")
        if size:  # whole (a split one whose parts were all still in memory is joined): kept decoded
            sent = handed[1] if handed is not None and handed[0] is traj else None  # joined: not as sent
            _decoded(rt).put(key, traj.event_id, (traj, sent), size)
    if gathering:  # after the member's reference: a crash in between finds one or the other
        rt.delete(MEMBERS, gathering)
    if outcome not in ("added", "replaced", "duplicate"):
        return
    if outcome != "duplicate":
        _save(rt, state)
    await advance(rt, state, now)


def _gather(rt: Runtime, key: str, part: Trajectory, size: int, partition: int,
            offset: int) -> tuple[Trajectory, bytes, int, str] | None:
    """Hold a part of a trajectory sent in parts (schemas/parts.py) until all of them are in, under
    ``<key>/<whole event id>`` in the members table (their references, in part order).

    Once complete: (the whole trajectory, its member reference, its size, the gathering key to delete).
    The whole is joined when every part is still in memory (size > 0); else it is its fields without
    traces (size 0), enough for the group's state, and the parts are read back when the group emits.
    None while parts are missing."""
    whole_id, gathering = part.part_of, f"{key}/{part.part_of}"
    decoded = _decoded(rt)
    decoded.put(f"{gathering}#{part.part}", part.event_id, (part, None), size)
    held = rt.get(MEMBERS, key)
    if held is not None and held.get("e") == whole_id:  # complete already: a part replayed after a crash
        refs = held["parts"]
    else:
        refs = (rt.get(MEMBERS, gathering) or {"parts": [None] * part.parts})["parts"]
        if refs[part.part] is None or refs[part.part]["e"] != part.event_id:
            refs[part.part] = reference(part.event_id, partition, offset)
            rt.put(MEMBERS, gathering, {"parts": refs})
        if any(r is None for r in refs):
            rt.count("members.parts_held")
            return None
    parts = [_member(decoded, f"{gathering}#{k}", r["e"]) for k, r in enumerate(refs)]
    member_ref = orjson.dumps({"e": whole_id, "parts": refs})
    if all(p is not None for p in parts):  # moved from the parts' entries to the whole's
        size = sum(decoded.pop(f"{gathering}#{k}") for k in range(len(refs)))
        return join_parts(parts), member_ref, size, gathering
    fields = part.model_copy(update={"event_id": whole_id, "traces": [], "part": 0, "parts": 1, "part_of": ""})
    return fields, member_ref, 0, gathering


async def on_tick(rt: Runtime, partition: int) -> None:
    """Deadlines of this partition's groups: only those whose wake-up time has come are read."""
    now = time.time()
    for key in _wakeups(rt).pop_due(partition, now):
        state = _load(rt, key)
        if state is None:
            continue
        if state.emitted:
            if now - state.closed_at >= rt.config.done_retention_s:
                _delete_members(rt, state)  # leftovers of a crash between the marker and the deletes
                rt.delete(GROUPS, key)
            else:
                _schedule(rt, state)
            continue
        await advance(rt, state, now)


def _wakeups(rt: Runtime) -> Wakeups:
    """This stage's wake-ups, built from the groups table after each rebalance."""
    return rt.index(STAGE, lambda: _rebuild_wakeups(rt))


def _rebuild_wakeups(rt: Runtime) -> Wakeups:
    wakeups = Wakeups()
    for raw in list(rt.tables[GROUPS].values()):
        _schedule_into(rt, GroupState.from_json(orjson.loads(raw)), wakeups)
    return wakeups


def _schedule(rt: Runtime, state: GroupState) -> None:
    _schedule_into(rt, state, _wakeups(rt))


def _schedule_into(rt: Runtime, state: GroupState, wakeups: Wakeups) -> None:
    """Wake the group at its deadline (``groups.due``), or when its emitted marker may be forgotten."""
    at = state.closed_at + rt.config.done_retention_s if state.emitted else due(state, rt.config)[1]
    wakeups.wake_by(state.partition, state.group_id, at)


def _save(rt: Runtime, state: GroupState) -> None:
    rt.put(GROUPS, state.group_id, state.to_json())
    _schedule(rt, state)


async def advance(rt: Runtime, state: GroupState, now: float) -> None:
    """Emit or drop the group if ``decide`` says so (acknowledged, then marked, then its members deleted)."""
    gid = state.group_id
    if rt.is_pending(STAGE, gid):
        _schedule(rt, state)  # looked at again at the next tick of the partition
        return
    action = decide(state, now, rt.config)
    if not action:
        _schedule(rt, state)
        return
    if action == "emit":
        members = await _stored_members(rt, state)
        if members is None:
            rt.count("groups.awaiting_replayed_member")
            _schedule(rt, state)  # due at once: retried at every tick until the bytes are back
            return  # a member's bytes are still being replayed after a restart
        masked_reasons: dict[str, str] = {}
        if rt.judge is not None:  # verdicts in (recorded, or asked for and recorded): rewards combined
            judged = await rt.judge.judge_members(members)
            members, masked_reasons = judged.members, judged.masked
            reason = drop_reason(judged, state.min_valid)
            if reason:
                rt.count("groups.dropped_judge")
                log.warning("group %s dropped (%s): too few usable after judging (min_valid %d): %s",
                            gid, reason, state.min_valid, masked_reasons)
                _close(rt, state, f"dropped:{reason}", now)
                return
        group = build_group(gid, members, rt.config, masked_reasons)
        if group is not None and rt.judge is not None and judged.call_scores:
            group = process_advantages(group, judged.call_scores, rt.config.judge.process_weight)
        if group is None:
            rt.count("groups.dropped_zero_variance")
            _close(rt, state, "dropped:zero_variance", now)
            return
        known = _known_bytes(rt, state, members)
        rt.count("members.bytes_reused", len(known))
        fut = await rt.send_split("groups", group, rt.topo.group_max_bytes, known)  # in parts past the limit
        if fut is None:
            _close(rt, state, "dropped:oversized", now)
            return
        metrics.observe_group(now - state.first_seen)
        # Marked emitted once the broker has every part (a crash before re-sends all of them, byte-identical).
        rt.pend(STAGE, gid, state.partition, fut, lambda: _close(rt, _load(rt, gid) or state, group.event_id, now))
        _schedule(rt, state)
        return
    rt.count(f"groups.{action.replace(':', '_')}")
    log.warning("group %s dropped (%s): %d of %d samples in, %d usable, min_valid %d",
                gid, action, len(state.members), state.num_samples, state.usable, state.min_valid)
    _close(rt, state, action, now)


def _known_bytes(rt: Runtime, state: GroupState, members: list[Trajectory]) -> list[tuple[Trajectory, bytes]]:
    """The members whose bytes this worker holds, as sent: the very objects in the group, never a copy."""
    decoded = _decoded(rt)
    held = (decoded.get(f"{state.group_id}/{t.sample_index}", t.event_id) for t in members)
    return [(t, h[1]) for h, t in zip(held, members) if h is not None and h[0] is t and h[1] is not None]


def _member(decoded: Recent[tuple[Trajectory, bytes | None]], key: str, event_id: str) -> Trajectory | None:
    hit = decoded.get(key, event_id)
    return None if hit is None else hit[0]


def _close(rt: Runtime, state: GroupState, emitted: str, now: float) -> None:
    state.emitted, state.closed_at = emitted, now
    _save(rt, state)
    _delete_members(rt, state)


async def _stored_members(rt: Runtime, state: GroupState) -> list[Trajectory] | None:
    """The members the state lists, or None while any is missing, is another attempt than listed, or
    could not be read back yet. A member sent in parts is joined from them."""
    found: dict[int, Trajectory] = {}
    refs: dict[tuple[int, int], dict] = {}  # (sample index, part) -> reference, for what is not in memory
    split: dict[int, list] = {}  # sample index -> its parts (None: to read back), for members sent in parts
    decoded = _decoded(rt)
    for i in state.members:
        key = f"{state.group_id}/{i}"
        raw = rt.tables[MEMBERS].get(key)
        if raw is None:
            return None
        held = orjson.loads(raw)
        if "e" not in held:  # written before references: the member itself
            found[i] = decode(raw, Trajectory)
            continue
        traj = _member(decoded, key, held["e"])
        if traj is not None:
            found[i] = traj
        elif "parts" in held:  # sent in parts: those not in memory are read back, then joined
            split[i] = [_member(decoded, f"{key}/{held['e']}#{k}", r["e"]) for k, r in enumerate(held["parts"])]
            refs.update(((i, k), r) for k, r in enumerate(held["parts"]) if split[i][k] is None)
        else:
            refs[(i, 0)] = held
    read: dict = {}
    if refs:
        read = await rt.read_back(rt.topo.trajectories, Trajectory, refs, "members")
        if read is None:
            return None
    for (i, k), traj in read.items():  # a gone member keeps the group waiting (until it expires)
        if i in split:
            split[i][k] = traj
        else:
            found[i] = traj
    for i, parts in split.items():
        if all(p is not None for p in parts):
            found[i] = join_parts(parts)
    if any(i not in found or found[i].event_id != member.event_id for i, member in state.members.items()):
        return None
    return [found[i] for i in sorted(found)]


def _delete_members(rt: Runtime, state: GroupState) -> None:
    decoded = _decoded(rt)
    for i, member in state.members.items():
        key = f"{state.group_id}/{i}"
        held = rt.get(MEMBERS, key)
        if held is not None and "e" in held:  # a reference (not a member's bytes): its parts' cache entries
            for k in range(len(held.get("parts", ()))):
                decoded.pop(f"{key}/{member.event_id}#{k}")
        rt.delete(MEMBERS, key)
        decoded.pop(key)
