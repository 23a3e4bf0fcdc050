"""Advantages against hand computations, and groups that survive a failed sample."""

import math

import pytest

from schemas import Trace, Trajectory
from streams.advantages import compute_advantages
from streams.config import StreamsConfig
from streams.groups import add_member, build_group, decide, due, new_group


def test_grpo_mean_std_by_hand():
    # rewards 1, 0, 0, 1: mean 0.5, population std 0.5
    adv = compute_advantages([1.0, 0.0, 0.0, 1.0], "mean", True, epsilon=1e-6)
    assert adv.mean == 0.5 and adv.std == 0.5 and not adv.zero_variance
    assert adv.values == pytest.approx([0.5 / 0.500001, -0.5 / 0.500001, -0.5 / 0.500001, 0.5 / 0.500001], abs=1e-12)


def test_leave_one_out_by_hand():
    # rewards 1, 0, 0: baselines (0+0)/2=0, (1+0)/2=0.5, 0.5; std = sqrt(((2/3)^2 + 2*(1/3)^2)/3)
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 3)
    adv = compute_advantages([1.0, 0.0, 0.0], "leave_one_out", True, epsilon=1e-6)
    assert adv.values == pytest.approx([1 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6)], abs=1e-12)
    plain = compute_advantages([1.0, 0.0, 0.0], "leave_one_out", False)
    assert plain.values == [1.0, -0.5, -0.5]


def test_no_std_and_epsilon():
    assert compute_advantages([3.0, 1.0], "mean", False).values == [1.0, -1.0]
    assert compute_advantages([3.0, 1.0], "mean", True, epsilon=1.0).values == [0.5, -0.5]


def test_zero_variance_is_flagged_with_zero_advantages():
    adv = compute_advantages([0.7, 0.7, 0.7], "leave_one_out", True)
    assert adv.zero_variance and adv.values == [0.0, 0.0, 0.0]
    single = compute_advantages([1.0], "mean", True)
    assert single.zero_variance and single.values == [0.0]


def test_empty_group_is_an_error():
    with pytest.raises(ValueError, match="at least one usable member"):
        compute_advantages([])


def traj(i, reward, usable=True, attempt=0, status="ok", n=4, min_valid=2, event=None, t=100.0):
    return Trajectory(
        event_id=event or f"t{i}a{attempt}", created_at=t + i, session_id=f"s{i}a{attempt}", group_id="g",
        sample_index=i, attempt=attempt, num_samples=n, min_valid=min_valid, status=status, reward=reward,
        usable=usable, traces=[Trace(call_indices=[0], token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0, -1], policy_versions=[3])],
    )


def test_failed_sample_does_not_sink_its_group():
    members = [traj(0, 1.0), traj(1, 0.0), traj(2, 0.0, usable=False, status="infra_error"), traj(3, 1.0)]
    group = build_group("g", members, StreamsConfig(advantage="grpo", epsilon=1e-6))
    assert [t.sample_index for t in group.trajectories] == [0, 1, 3]
    assert group.masked == ["s2a0"]
    # baseline over the usable three only: mean 2/3, std sqrt(2)/3
    mean, std = 2 / 3, math.sqrt(2) / 3
    assert group.advantages == pytest.approx([(1 - mean) / (std + 1e-6), (0 - mean) / (std + 1e-6), (1 - mean) / (std + 1e-6)])
    assert group.reward_mean == pytest.approx(mean) and group.policy_versions == [3]


def test_group_ids_and_bytes_are_deterministic():
    from schemas import encode
    members = [traj(0, 1.0), traj(1, 0.0)]
    a = build_group("g", members, StreamsConfig())
    b = build_group("g", list(reversed(members)), StreamsConfig())
    assert encode(a) == encode(b) and a.created_at == 101.0
    assert build_group("g", members, StreamsConfig(advantage="loo")).event_id != a.event_id


def test_zero_variance_group_kept_flagged_or_dropped():
    members = [traj(0, 1.0), traj(1, 1.0)]
    assert build_group("g", members, StreamsConfig()).zero_variance
    assert build_group("g", members, StreamsConfig(zero_variance="drop")) is None


def test_gathering_retries_duplicates_and_deadlines():
    cfg = StreamsConfig(group_deadline_s=10, group_expire_s=100)
    state = new_group(traj(0, 0.0), now=0.0, partition=0)
    assert add_member(state, traj(0, 0.0, usable=False, status="infra_error")) == "added"
    assert add_member(state, traj(0, 0.0, usable=False, status="infra_error")) == "duplicate"
    assert add_member(state, traj(0, 1.0, attempt=1)) == "replaced"  # the retry replaces attempt 0
    assert add_member(state, traj(0, 0.0, usable=False, status="infra_error")) == "stale_attempt"
    assert add_member(state, traj(0, 1.0, attempt=1, event="other")) == "conflict"
    assert state.members[0].usable and state.members[0].attempt == 1
    assert decide(state, 5.0, cfg) == ""
    assert add_member(state, traj(1, 0.0)) == "added"
    assert decide(state, 5.0, cfg) == ""  # 2 of 4 in, before the deadline
    assert due(state, cfg) == ("emit", 10.0)  # what a replay's end of input runs time on to
    assert decide(state, 10.0, cfg) == "emit"  # deadline, min_valid=2 usable
    assert add_member(state, traj(2, 0.0)) == "added" and add_member(state, traj(3, 0.0, usable=False)) == "added"
    assert decide(state, 1.0, cfg) == "emit"  # all four in
    state.emitted = "x"
    assert add_member(state, traj(1, 1.0, attempt=2)) == "late" and decide(state, 1.0, cfg) == ""
    assert due(state, cfg) == ("", float("inf"))


def test_too_few_usable_waits_then_drops():
    cfg = StreamsConfig(group_deadline_s=10, group_expire_s=100)
    state = new_group(traj(0, 0.0), now=0.0, partition=0)
    add_member(state, traj(0, 1.0))
    assert decide(state, 50.0, cfg) == ""  # past the deadline but only 1 usable of min_valid 2
    assert due(state, cfg) == ("drop:expired", 100.0)
    assert decide(state, 100.0, cfg) == "drop:expired"
    for i in (1, 2, 3):
        add_member(state, traj(i, 0.0, usable=False))
    assert decide(state, 1.0, cfg) == "drop:too_few_usable"


def test_state_round_trips_through_json():
    from streams.groups import GroupState
    state = new_group(traj(0, 0.0), now=3.0, partition=2)
    add_member(state, traj(0, 1.0))
    assert GroupState.from_json(state.to_json()) == state


def test_overlong_shaping_enters_the_advantages_and_trajectories_keep_their_reward():
    """DAPO's soft overlong punishment on each trajectory's sampled tokens (L_max 3, L_cache 2): 1 token: 0; 2: -0.5;
    4: -1. Rewards 1, 1, 1 become 1, 0.5, 0: advantages by hand with no_std (r - mean)."""
    def sized(i, sampled):
        t = traj(i, 1.0)
        n = sampled + 1
        return t.model_copy(update={"traces": [Trace(call_indices=[0], token_ids=[1] * n, loss_mask=[0] + [1] * sampled,
                                                     logprobs=[0.0] * n, policy_versions=[3])]})

    members = [sized(0, 1), sized(1, 2), sized(2, 4)]
    cfg = StreamsConfig(advantage="no_std", overlong_max_tokens=3, overlong_buffer=2)
    group = build_group("g", members, cfg)
    assert group.advantages == pytest.approx([0.5, 0.0, -0.5])
    assert [t.reward for t in group.trajectories] == [1.0, 1.0, 1.0]  # the evaluator's, as recorded
    assert build_group("g", members, StreamsConfig(advantage="no_std")).zero_variance  # off: all rewards 1
    assert group.event_id != build_group("g", members, StreamsConfig(advantage="no_std")).event_id
    with pytest.raises(ValueError, match="overlong_buffer"):
        StreamsConfig(overlong_max_tokens=3, overlong_buffer=5)
