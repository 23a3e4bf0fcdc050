"""Session bookkeeping and trajectories from recorded sessions (synthetic tokens)."""

import pytest

from schemas import encode
from streams.assembly import CallTokens
from streams.config import StreamsConfig
from streams.sessions import SessionState, add_call, add_finished, decide, due, new_session
from streams.synthetic import SessionSpec, record_session
from streams.trajectory import build_trajectory


def tokens(rec):
    return [CallTokens.from_record(c) for c in rec.calls]


def test_session_completes_only_with_finished_and_all_calls():
    rec = record_session(SessionSpec("s", "g", turns=3))
    cfg = StreamsConfig(missing_calls_grace_s=30)
    st = new_session("s", 0.0, 0)
    assert add_call(st, 2, "s-c2", 1.0) == "added"  # out of order
    assert add_finished(st, rec.finished, 2.0) == "added"
    assert decide(st, 3.0, cfg) == "" and st.missing_calls == 2
    held = {2: "s-c2"}.get  # the event id stored with the call's data (the session-calls table)
    assert add_call(st, 2, "s-c2", 3.0, held) == "duplicate" and add_call(st, 2, "other", 3.0, held) == "conflict"
    assert add_finished(st, rec.finished, 3.0) == "duplicate"
    add_call(st, 0, "s-c0", 4.0)
    add_call(st, 1, "s-c1", 4.0)
    assert decide(st, 4.0, cfg) == "assemble" and st.missing_calls == 0
    assert SessionState.from_json(st.to_json()) == st


def test_missing_calls_assemble_after_grace_and_mask():
    rec = record_session(SessionSpec("s", "g", turns=3))
    cfg = StreamsConfig(missing_calls_grace_s=30, missing_calls_timeout_s=300, session_expire_s=100, done_retention_s=5)
    st = new_session("s", 0.0, 0)
    add_call(st, 0, "s-c0", 0.0)
    add_finished(st, rec.finished, 1.0)
    seen = rec.finished.created_at + 30  # calls processed through 30 s after the finished event
    assert decide(st, 30.0, cfg, seen) == "" and decide(st, 31.0, cfg, seen) == "assemble"
    assert due(st, cfg, seen) == ("assemble", 31.0) and due(st, cfg, seen - 1) == ("assemble", 301.0)
    assert decide(st, 31.0, cfg, seen - 1) == ""  # the calls topic lags: a missing call may still come
    assert decide(st, 300.0, cfg, 0.0) == "" and decide(st, 301.0, cfg, 0.0) == "assemble"  # idle partition
    traj = build_trajectory(rec.finished, tokens(rec)[:1], cfg, missing_calls=st.missing_calls)
    assert not traj.usable and traj.stats["missing_calls"] == 2 and traj.metrics["masked.missing_calls"] == 1.0
    st.done, st.done_at = traj.event_id, 40.0
    assert add_call(st, 1, "s-c1", 41.0) == "late" and decide(st, 44.0, cfg) == "" and decide(st, 45.0, cfg) == "forget"
    orphan = new_session("o", 0.0, 0)
    add_call(orphan, 0, "o-c0", 0.0)
    assert decide(orphan, 99.0, cfg) == "" and decide(orphan, 100.0, cfg) == "drop:no_finished"


def test_trajectory_is_a_pure_function_of_its_inputs():
    rec = record_session(SessionSpec("s", "g", turns=4, side_call_at=1, compaction_at=3))
    cfg = StreamsConfig()
    a = build_trajectory(rec.finished, tokens(rec), cfg)
    b = build_trajectory(rec.finished, list(reversed(tokens(rec))), cfg)
    assert encode(a) == encode(b)
    assert a.created_at == rec.finished.created_at and a.usable and a.reward == 1.0
    assert [t.break_reason for t in a.traces] == ["first_call", "side_call", "compaction"]
    assert a.stats["break.compaction"] == 1 and a.stats["merged"] == 2
    other = build_trajectory(rec.finished, tokens(rec), StreamsConfig(builder="per_request"))
    assert other.event_id != a.event_id and len(other.traces) == 5


@pytest.mark.parametrize("status, reward, usable, expect_reward, why", [
    ("ok", 1.0, True, 1.0, None),
    ("timeout", 1.0, True, 0.0, None),  # agent-budget timeout: trainable, reward 0
    ("failed", 1.0, False, 0.0, "masked.status_failed"),
    ("infra_error", None, False, 0.0, "masked.status_infra_error"),
    ("ok", None, False, 0.0, "masked.no_reward"),
])
def test_status_decides_usable_and_reward(status, reward, usable, expect_reward, why):
    rec = record_session(SessionSpec("s", "g", turns=2, status=status, reward=reward))
    traj = build_trajectory(rec.finished, tokens(rec), StreamsConfig())
    assert (traj.usable, traj.reward) == (usable, expect_reward)
    if why:
        assert traj.metrics[why] == 1.0
    if status == "timeout":
        assert traj.metrics["raw_reward"] == 1.0


def test_session_without_calls_is_unusable_not_a_crash():
    rec = record_session(SessionSpec("s", "g", turns=1))
    traj = build_trajectory(rec.finished, [], StreamsConfig())
    assert not traj.usable and traj.traces == [] and traj.metrics["masked.no_trainable_tokens"] == 1.0
