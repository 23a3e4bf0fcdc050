"""SIGKILL workers mid-stream: the deduplicated groups equal an uninterrupted run's, byte for byte.

The same recorded sessions (identical bytes, identical event ids) go to two topic prefixes. One worker
processes the first prefix without interruption. On the second, two workers share the partitions (one
consumer group); while groups are coming out, worker A is killed with SIGKILL (no shutdown, no final
commit) and B takes its partitions over; A is restarted and rejoins; then B is killed and restarted.
At-least-once replays whatever was processed but not yet committed, so polar.groups may hold raw
duplicates; deduplicated by event_id, as every consumer reads it, nothing may differ and nothing may
be missing.
"""

from __future__ import annotations

import json
import time
import uuid

from infra.topics import delete_topics, ensure_topics
from schemas import TrainingGroup, Trajectory, decode
from streams.synthetic import record_group
from tests.streams.helpers import WorkerProcess, dedupe, publish, read_topic

GROUPS = 24
ARGS = ["--tick-interval", "0.5", "--stats-interval", "1", "--session-timeout", "6"]


def recorded_groups():
    """The records of each group, group by group."""
    groups = []
    for g in range(GROUPS):
        rewards = [float(g % 3 == 0), 1.0, 0.5, float(g % 2)]
        groups.append([r for s in record_group(f"k{g}", rewards, seed=g, turns=6, side_call_at=2, min_valid=2) for r in s.records])
    return groups


def diagnosis(*workers) -> str:
    """What a failure needs: each worker's warnings and errors, and its last counters."""
    out = []
    for w in workers:
        lines = w.log_text().splitlines()
        out += [l for l in lines if ("[WARNING]" in l or "[ERROR]" in l) and "producer buffer full" not in l][-40:]
        out += [l for l in lines if "streams counters" in l][-1:]
    return "\n".join(out)


def distinct_keys(n):
    return lambda msgs: len({m.key for m in msgs}) >= n


def test_kill_and_restart_mid_stream_loses_and_changes_nothing(polar_settings, tmp_path, record_property):
    groups = recorded_groups()
    records = [r for g in groups for r in g]
    third = GROUPS // 3
    other = polar_settings.model_copy(update={"topic_prefix": f"k{uuid.uuid4().hex[:8]}.", "data_dir": tmp_path / "other"})
    other.data_dir.mkdir()
    ensure_topics(other)
    try:
        publish(polar_settings, records)
        # The killed run's input arrives in thirds, the next third only after a kill, so each kill is
        # sure to land while groups are still being emitted (on a fast machine everything published at
        # once can be out before the first kill).
        publish(other, [r for g in groups[:third] for r in g])

        # Uninterrupted reference run.
        ref = WorkerProcess(polar_settings, tmp_path / "ref.log", ARGS).start()
        try:
            ref_groups, ref_dups = dedupe(read_topic(polar_settings, "groups", until=distinct_keys(GROUPS), timeout=120, idle=1.0), TrainingGroup)
        finally:
            ref.stop()
        assert len(ref_groups) == GROUPS and ref_dups == 0, ref.log_text()[-2000:]

        # Two workers; each killed once while groups are being emitted.
        a = WorkerProcess(other, tmp_path / "a.log", ARGS).start()
        b = WorkerProcess(other, tmp_path / "b.log", ARGS).start()
        kills = []
        try:
            for victim, kill_at, restart_at, more in ((a, GROUPS // 6, GROUPS // 3, groups[third:2 * third]),
                                                      (b, GROUPS // 2, 2 * GROUPS // 3, groups[2 * third:])):
                read_topic(other, "groups", until=distinct_keys(kill_at), timeout=120)
                victim.kill()
                kills.append(len({m.key for m in read_topic(other, "groups", timeout=1)}))
                publish(other, [r for g in more for r in g])
                out = read_topic(other, "groups", until=distinct_keys(restart_at), timeout=120)
                assert len({m.key for m in out}) >= restart_at, "the surviving worker stalled"
                victim.start()
            msgs = read_topic(other, "groups", until=distinct_keys(GROUPS), timeout=180, idle=3.0)
        finally:
            a.stop()
            b.stop()
        got, dups = dedupe(msgs, TrainingGroup)
        _, traj_dups = dedupe(read_topic(other, "trajectories", timeout=3), Trajectory)

        assert kills[0] < GROUPS and kills[1] < GROUPS, f"a kill landed after the stream finished: {kills}"
        assert set(got) == set(ref_groups), diagnosis(a, b)  # none missing, none extra
        assert all(got[k] == ref_groups[k] for k in got)  # byte for byte
        report = {"groups": len(got), "raw_group_messages": len(msgs), "raw_group_duplicates": dups,
                  "raw_trajectory_duplicates": traj_dups, "groups_out_at_each_kill": kills}
        record_property("kill_report", json.dumps(report))
        print("\nkill test:", json.dumps(report))
    finally:
        try:
            delete_topics(other, timeout=10)
        except Exception:  # cleanup only
            pass


def test_a_worker_joining_under_a_backlog_loses_nothing(polar_settings, tmp_path):
    """A rebalance while a stage is behind: Faust skipped the events queued for it and acked them, and
    dropped records fetched for a partition not active yet then committed past the "gap", so inputs no
    stage had seen were committed (streams/app._commit_only_handled, Runtime._catch_up; this test caught
    the second). Worker A works through a backlog; B joins midway; every session must come out with all
    its calls, every group complete."""
    n = 160  # about 15 s of work for one worker: B joins while A's queue is full
    records = [r for g in range(n)
               for s in record_group(f"j{g}", [1.0, 0.0, 1.0, 0.0], seed=g, turns=6, side_call_at=2, min_valid=2)
               for r in s.records]
    publish(polar_settings, records)
    a = WorkerProcess(polar_settings, tmp_path / "a.log", ARGS).start()
    b = WorkerProcess(polar_settings, tmp_path / "b.log", ARGS)
    try:
        read_topic(polar_settings, "trajectories", until=lambda msgs: len(msgs) >= 40, timeout=120)
        b.start()
        msgs = read_topic(polar_settings, "groups", until=distinct_keys(n), timeout=180, idle=1.0)
    finally:
        a.stop()
        b.stop()
    got = [decode(v, TrainingGroup) for v in dedupe(msgs, TrainingGroup)[0].values()]
    incomplete = [g.group_id for g in got if g.masked or len(g.trajectories) != 4]
    out = {g.group_id for g in got}
    assert len(out) == n and not incomplete, f"{n - len(out)} missing, incomplete {incomplete}\n{diagnosis(a, b)}"
