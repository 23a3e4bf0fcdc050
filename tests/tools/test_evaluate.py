"""Evaluation numbers against a hand computation on a small fixture."""

from __future__ import annotations

import pytest

from polarstream.tools.eval_run import EvalState
from polarstream.tools.evaluate import Latest, Sample, evaluate
from producers.kafka_read import RawMessage
from schemas import encode
from tests.tools.samples import traj


def fixture_trajectories():
    return [
        # codex, version 0: task t1 has 4 samples, 2 pass (n=4, c=2).
        traj("t1", 0, 1.0, turns=2, side_call=True), traj("t1", 1, 0.0, turns=3), traj("t1", 2, 1.0, turns=2, compaction=True),
        traj("t1", 3, 0.0, turns=1),
        # task t2: a pass, a timeout, and an infra error whose retry (attempt 1) failed: n=3, c=1.
        traj("t2", 0, 1.0, turns=2), traj("t2", 1, 0.0, "timeout", turns=4), traj("t2", 2, 0.0, "infra_error", turns=1),
        traj("t2", 2, 0.0, attempt=1, turns=3),
        # codex, version 1: task t3, both pass; one trajectory arrives twice.
        traj("t3", 0, 1.0, version=1), traj("t3", 1, 1.0, version=1), traj("t3", 1, 1.0, version=1),
        # claude_code, version 0, another task set: a failed session only (excluded: nothing to score).
        traj("t4", 0, 0.0, "failed", harness="claude_code", task_set="hard"),
    ]


def test_metrics_match_the_hand_computation():
    latest = Latest()
    for t in fixture_trajectories():
        latest.add(t)
    assert (latest.duplicates, latest.superseded) == (1, 1)
    cells = evaluate(latest.samples.values(), ks=(2, 4), threshold=1.0)
    assert [(c["harness"], c["policy_version"], c["task_set"]) for c in cells] == [
        ("claude_code", 0, "hard"), ("codex", 0, "default"), ("codex", 1, "default")]
    empty, v0, v1 = cells

    # t1: n=4, c=2 -> pass@1 1/2, pass@2 1 - C(2,2)/C(4,2) = 5/6, pass@4 = 1.
    # t2: n=3, c=1 -> pass@1 1/3, pass@2 1 - C(2,2)/C(3,2) = 2/3, pass@4 undefined (n < 4).
    assert v0["samples"] == 7 and v0["tasks"] == 2 and v0["passed"] == 3
    assert v0["pass@1"] == pytest.approx((1 / 2 + 1 / 3) / 2)
    assert v0["pass@2"] == pytest.approx((5 / 6 + 2 / 3) / 2)
    assert v0["pass@4"] == pytest.approx(1.0) and v0["tasks@4"] == 1
    assert v0["mean_reward"] == pytest.approx(3 / 7)
    assert v0["timeouts"] == 1 and v0["timeout_rate"] == pytest.approx(1 / 7)
    # turns: t1 2+3+2+1 (the side call is not a turn), t2 2+4+3
    assert v0["mean_turns"] == pytest.approx(17 / 7)
    # 5 tokens per call (2 sampled): 17 main calls + 1 side call
    assert v0["tokens"] == 5 * 18 and v0["sampled_tokens"] == 2 * 18
    assert v0["merge_breaks"] == {"compaction": 1}
    assert v0["statuses"] == {"ok": 6, "timeout": 1}  # the infra error was superseded by its retry
    assert v0["per_task"] == {"t1": {"n": 4, "c": 2}, "t2": {"n": 3, "c": 1}}

    assert v1["pass@1"] == 1.0 and v1["pass@2"] == 1.0 and v1["pass@4"] is None and v1["tasks@4"] == 0
    assert empty["samples"] == 0 and empty["excluded"] == 1 and empty["pass@1"] is None
    assert empty["masked_from_training"] == {"status_failed": 1}


def test_threshold_decides_what_passes():
    samples = [Sample.of(traj("t", i, r)) for i, r in enumerate([0.2, 0.6, 1.0])]
    (cell,) = evaluate(samples, threshold=0.5)
    assert cell["pass@1"] == pytest.approx(2 / 3)
    timeout = Sample.of(traj("u", 0, 1.0, "timeout"))  # a timeout never passes, whatever its reward
    (cell,) = evaluate([timeout], threshold=0.5)
    assert cell["passed"] == 0


def test_latest_attempt_wins_whatever_the_arrival_order():
    late_first = [traj("t", 0, 0.0, attempt=1), traj("t", 0, 1.0, "infra_error")]
    latest = Latest()
    for t in late_first:
        latest.add(t)
    (sample,) = latest.samples.values()
    assert sample.attempt == 1 and latest.superseded == 1


def test_policy_version_is_the_first_calls():
    t = traj("t", 0, 1.0, version=3, compaction=True)
    t.traces[1].policy_versions[:] = [4]  # weights changed mid-session
    assert Sample.of(t).policy_version == 3


def test_eval_state_reads_both_encodings_and_skips_undecodable_messages():
    state = EvalState("polar.trajectories", (1,), 1.0)
    assert state.feed(RawMessage("trajectories", 0, 0, 0, b"t", encode(traj("t", 0, 1.0))))
    assert state.feed(RawMessage("trajectories", 0, 1, 0, b"t", encode(traj("t", 1, 0.0), packed=True)))
    assert not state.feed(RawMessage("trajectories", 0, 2, 0, b"t", b"{not json"))
    assert not state.feed(RawMessage("trajectories", 0, 3, 0, b"t", b"PSR1\x00"))  # a truncated container
    report = state.report()
    assert report["source"]["undecodable"] == 2 and report["cells"][0]["pass@1"] == 0.5


def test_bad_k_is_refused():
    with pytest.raises(ValueError, match="k"):
        evaluate([], ks=(0,))


def test_a_trajectory_sent_in_parts_is_one_sample_once_all_parts_are_in():
    from schemas import split_record

    whole = traj("g", 0, 1.0, compaction=True, side_call=True)
    parts = [p for p, _ in split_record(whole, len(encode(whole)) - 1)]
    assert len(parts) > 1
    latest = Latest()
    assert [latest.add(p) for p in parts] == [False] * (len(parts) - 1) + [True]
    assert latest.samples[("g", 0)] == Sample.of(whole)  # its tokens and turns counted from every trace
    assert not latest.add(parts[0]) and latest.duplicates == 1


def test_an_experiments_eval_counts_failed_and_infra_error_samples_as_not_passing():
    """What an experiment's eval reports: a sandbox that broke cannot raise pass@1 by leaving its sample out;
    a cancelled sample (stopped on purpose) still stays out."""
    samples = [Sample.of(traj("t", 0, 1.0)), Sample.of(traj("t", 1, 0.0, "infra_error")), Sample.of(traj("t", 2, 0.0, "failed")),
               Sample.of(traj("t", 3, 0.0, "cancelled"))]
    (plain,) = evaluate(samples, ks=(1, 3))
    (strict,) = evaluate(samples, ks=(1, 3), failures_fail=True)
    assert plain["pass@1"] == 1.0 and plain["samples"] == 1 and plain["excluded"] == 3
    assert strict["pass@1"] == pytest.approx(1 / 3) and strict["samples"] == 3 and strict["excluded"] == 1
    assert strict["pass@3"] == 1.0 and strict["per_task"] == {"t": {"n": 3, "c": 1}}
