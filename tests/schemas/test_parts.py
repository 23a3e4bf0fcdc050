"""A group past the record limit goes out in parts that join back to it exactly (schemas/parts.py)."""

from __future__ import annotations

import random

import pytest

from schemas import (GroupParts, GroupTooLarge, RecordDecodeError, Trace, TrainingGroup, Trajectory, decode, encode,
                     join_parts, split_group)


def group(samples: int = 6, tokens: int = 400, seed: int = 0) -> TrainingGroup:
    rng = random.Random(seed)
    trajs = []
    for i in range(samples):
        n = tokens + rng.randrange(tokens)  # members of different sizes
        trace = Trace(call_indices=[0], token_ids=[rng.randrange(50_000) for _ in range(n)], loss_mask=[i % 2] * n,
                      logprobs=[-rng.random() if i % 2 else 0.0 for _ in range(n)], policy_versions=[2])
        trajs.append(Trajectory(session_id=f"s{i}", group_id="g", task_id="t", sample_index=i, num_samples=samples + 1,
                                reward=float(i % 2), traces=[trace]))
    return TrainingGroup(group_id="g", task_id="t", trajectories=trajs, advantages=[(-1.0) ** i * 0.123456789 for i in range(samples)],
                         masked=["s-failed"], reward_mean=0.5, reward_std=0.5, policy_versions=[2])


def test_a_group_that_fits_goes_out_as_itself():
    g = group()
    data = encode(g)
    assert split_group(g, len(data)) == [(g, data)]


@pytest.mark.parametrize("limit_over_largest", [1.0, 1.6, 2.5])
def test_parts_stay_under_the_limit_and_join_back_to_the_group(limit_over_largest):
    g = group()
    largest = max(len(encode(t)) for t in g.trajectories)
    limit = int(largest * limit_over_largest) + 600  # room for the part's own fields
    parts = split_group(g, limit)
    assert len(parts) > 1
    for k, (part, data) in enumerate(parts):
        assert len(data) <= limit and data == encode(part)
        assert decode(data, TrainingGroup) == part  # each part is a valid record on its own
        assert (part.part, part.parts, part.part_of) == (k, len(parts), g.event_id)
        assert part.masked == (g.masked if k == 0 else [])
    # Every member once, in sample order, with its own advantage.
    members = [(t.sample_index, a) for p, _ in parts for t, a in zip(p.trajectories, p.advantages)]
    assert members == [(t.sample_index, a) for t, a in zip(g.trajectories, g.advantages)]
    assert len({p.event_id for p, _ in parts} | {g.event_id}) == len(parts) + 1
    assert encode(join_parts([p for p, _ in reversed(parts)])) == encode(g)
    assert [d for _, d in split_group(g, limit)] == [d for _, d in parts]  # a re-send is byte-identical


def test_a_member_too_large_for_any_part_is_refused():
    g = group()
    with pytest.raises(GroupTooLarge, match="alone is"):
        split_group(g, max(len(encode(t)) for t in g.trajectories))


def test_reader_joins_parts_in_any_order_and_passes_whole_groups_through():
    g = group()
    parts = [p for p, _ in split_group(g, len(encode(g)) // 2)]
    other = group(seed=1)
    joiner = GroupParts()
    assert joiner.add(other) is other
    random.Random(3).shuffle(parts)
    got = [joiner.add(p) for p in parts]
    assert got[:-1] == [None] * (len(parts) - 1)
    assert encode(got[-1]) == encode(g)


@pytest.mark.parametrize("fields, problem", [({"part": 2, "parts": 2, "part_of": "x"}, "below the count"),
                                             ({"parts": 2}, "part_of"), ({"part_of": "x"}, "part_of")])
def test_inconsistent_part_fields_do_not_decode(fields, problem):
    data = encode(group(samples=1).model_copy(update=fields))
    with pytest.raises(RecordDecodeError, match=problem):
        decode(data, TrainingGroup)
