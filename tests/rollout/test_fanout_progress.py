"""Fan-out (keys, mixes) and progress folding, without Kafka."""

from __future__ import annotations

import pytest

from producers.rollout.fanout import FanOutError, cancel_marker, fan_out
from producers.rollout.progress import apply_event, new_task_state
from schemas import HarnessSpec, SessionEvent, TaskRequest
from schemas.session_keys import verify_session_key

SECRET = "s3cret"


def task(**kw) -> TaskRequest:
    return TaskRequest(task_id="t1", instruction="do", num_samples=4, min_valid=2, **kw)


def test_fan_out_mints_scoped_keys_with_deterministic_ids():
    sessions = fan_out(task(), SECRET)
    assert [s.session_id for s in sessions] == ["t1.s0", "t1.s1", "t1.s2", "t1.s3"]
    claims = verify_session_key(sessions[2].session_key, SECRET)
    assert (claims.session_id, claims.group_id, claims.task_id, claims.sample_index, claims.attempt) == ("t1.s2", "t1", "t1", 2, 0)
    assert [s.event_id for s in fan_out(task(), SECRET)] == [s.event_id for s in sessions]  # same task, same records
    assert len({s.session_key for s in sessions}) == 4
    assert claims.run == ""  # the default topic prefix: no run claim, the key as before runs existed


def test_fan_out_keys_name_their_run():
    """The run's topic prefix rides in every key, so a shared gateway records the calls in that run's topics."""
    sessions = fan_out(task(), SECRET, run="exp7.")
    assert {verify_session_key(s.session_key, SECRET).run for s in sessions} == {"exp7."}
    assert [s.event_id for s in sessions] == [s.event_id for s in fan_out(task(), SECRET)]  # same sessions either way


def test_mix_alternates_harnesses_per_sample():
    mix = HarnessSpec(name="mix", config={"harnesses": [{"name": "qwen_code"}, {"name": "pi", "config": {"api": "anthropic"}}]})
    sessions = fan_out(task(harness=mix), SECRET)
    assert [s.task.harness.name for s in sessions] == ["qwen_code", "pi", "qwen_code", "pi"]
    assert sessions[1].task.harness.config == {"api": "anthropic"}
    assert verify_session_key(sessions[1].session_key, SECRET).harness == "pi"
    with pytest.raises(FanOutError, match=r"harness.config.harnesses\[1\].nme: Extra inputs"):
        fan_out(task(harness=HarnessSpec(name="mix", config={"harnesses": [{"name": "pi"}, {"nme": "x"}]})), SECRET)
    with pytest.raises(FanOutError, match="non-empty list"):
        fan_out(task(harness=HarnessSpec(name="mix")), SECRET)


def test_cancel_marker_keeps_the_task_and_has_a_stable_id():
    t = task()
    m = cancel_marker(t, "early_stop")
    assert m.cancelled == "early_stop" and m.task_id == t.task_id and m.event_id == cancel_marker(t, "x").event_id


def ev(kind, i, attempt=0, **kw) -> SessionEvent:
    sid = f"t1.s{i}" + (f".a{attempt}" if attempt else "")
    return SessionEvent(session_id=sid, task_id="t1", group_id="t1", sample_index=i, attempt=attempt, kind=kind, **kw)


def test_progress_counts_usable_and_follows_the_latest_attempt():
    t = task(early_stop=2)
    st = new_task_state(t, [s.session_id for s in fan_out(t, SECRET)])
    apply_event(st, ev("started", 0))
    apply_event(st, ev("finished", 0, status="ok", reward=1.0, num_calls=3))
    apply_event(st, ev("finished", 1, status="ok", reward=0.0, num_calls=0))  # no calls: not usable
    assert (st.usable, st.finished, st.should_stop_early()) == (1, 2, False)
    # sample 2's node died: the re-run (attempt 1) replaces it, the lost-attempt marker is ignored after
    apply_event(st, ev("started", 2))
    apply_event(st, ev("started", 2, attempt=1))
    assert not apply_event(st, ev("harness_exited", 2, status="infra_error"))
    apply_event(st, ev("finished", 2, attempt=1, status="ok", reward=1.0, num_calls=2))
    assert st.samples[2].session_id == "t1.s2.a1" and st.usable == 2 and st.should_stop_early()
    s = st.summary(samples=True)
    assert s["state"] == "running" and s["retried"] == 1 and s["reward_mean"] == pytest.approx(2 / 3)
    assert s["stages"] == {"assigned": 1, "started": 0, "harness_exited": 0, "evaluated": 0, "finished": 3}
    st.cancelled = "early_stop"
    assert not st.should_stop_early()
    apply_event(st, ev("finished", 3, status="cancelled"))
    assert st.done and st.summary()["state"] == "done" and st.finished_at is not None
