"""A record past its topic's limit goes out in parts that join back to it exactly (schemas/parts.py)."""

from __future__ import annotations

import random
import struct
from functools import partial

import pytest

from schemas import (Parts, RecordDecodeError, RecordTooLarge, Trace, TrainingGroup, Trajectory, decode, encode,
                     float32_digits, join_parts, split_record)
from schemas.packed import NESTING_BYTES_PER_ARRAY, array_count

# Every test runs on both encodings: JSON, and packed arrays (schemas/packed.py).
both = pytest.mark.parametrize("packed", [False, True], ids=["json", "packed"])


def f32(x: float) -> float:
    """A logprob as the gateway records one: a float32, at its 9 digits."""
    return float32_digits(struct.unpack("<f", struct.pack("<f", x))[0])


def trajectory(i: int, traces: int = 3, tokens: int = 400, rng: random.Random | None = None) -> Trajectory:
    rng = rng or random.Random(i)
    out = []
    for k in range(traces):
        n = tokens + rng.randrange(tokens)  # traces of different sizes
        out.append(Trace(call_indices=[k], token_ids=[rng.randrange(50_000) for _ in range(n)], loss_mask=[k % 2] * n,
                         logprobs=[f32(-rng.random()) if k % 2 else 0.0 for _ in range(n)], policy_versions=[2]))
    return Trajectory(session_id=f"s{i}", group_id="g", task_id="t", sample_index=i, num_samples=7, reward=float(i % 2),
                      traces=out, stats={"calls": float(traces)}, metrics={"tests_passed": 1.0})


def group(samples: int = 6, seed: int = 0, **kw) -> TrainingGroup:
    rng = random.Random(seed)
    return TrainingGroup(group_id="g", task_id="t", trajectories=[trajectory(i, rng=rng, **kw) for i in range(samples)],
                         advantages=[(-1.0) ** i * 0.123456789 for i in range(samples)], masked=["s-failed"],
                         masked_reasons={"s-failed": "judge:timeout"},
                         reward_mean=0.5, reward_std=0.5, policy_versions=[2])


@both
@pytest.mark.parametrize("record", [group(), trajectory(0)], ids=["group", "trajectory"])
def test_a_record_that_fits_goes_out_as_itself(record, packed):
    data = encode(record, packed=packed)
    assert split_record(record, len(data), packed=packed) == [(record, data)]


def check_parts(whole, parts, limit, packed):
    """Each part under the limit, valid alone, numbered, with a re-send byte-identical; joined, the whole."""
    encode = partial(globals()["encode"], packed=packed)
    assert len(parts) > 1
    for k, (part, data) in enumerate(parts):
        assert len(data) <= limit and data == encode(part)
        assert decode(data, type(whole)) == part
        assert (part.part, part.parts, part.part_of) == (k, len(parts), whole.event_id)
    assert len({p.event_id for p, _ in parts} | {whole.event_id}) == len(parts) + 1
    assert encode(join_parts([p for p, _ in reversed(parts)])) == encode(whole)
    assert [d for _, d in split_record(whole, limit, packed=packed)] == [d for _, d in parts]


@both
@pytest.mark.parametrize("limit_over_largest", [1.0, 1.6, 2.5])
def test_group_parts_share_its_trajectories(limit_over_largest, packed):
    encode = partial(globals()["encode"], packed=packed)
    g = group()
    # + room for the part's own fields and, packed, for its members' longer array paths
    limit = int(max(len(encode(t)) + NESTING_BYTES_PER_ARRAY * array_count(encode(t)) for t in g.trajectories)
                * limit_over_largest) + 600
    parts = split_record(g, limit, packed=packed)
    check_parts(g, parts, limit, packed)
    members = [(t.sample_index, a) for p, _ in parts for t, a in zip(p.trajectories, p.advantages)]
    assert members == [(t.sample_index, a) for t, a in zip(g.trajectories, g.advantages)]  # once each, in order
    assert [p.masked for p, _ in parts] == [g.masked] + [[]] * (len(parts) - 1)
    assert [p.masked_reasons for p, _ in parts] == [g.masked_reasons] + [{}] * (len(parts) - 1)


@both
def test_trajectory_parts_share_its_traces_and_keep_its_fields(packed):
    encode = partial(globals()["encode"], packed=packed)
    t = trajectory(1, traces=8)
    limit = len(encode(t)) // 3
    parts = split_record(t, limit, packed=packed)
    check_parts(t, parts, limit, packed)
    assert [tr for p, _ in parts for tr in p.traces] == t.traces
    assert all((p.session_id, p.reward, p.stats, p.metrics) == (t.session_id, t.reward, t.stats, t.metrics) for p, _ in parts)


@both
def test_a_member_too_large_for_a_group_part_goes_as_its_own_parts(packed):
    encode = partial(globals()["encode"], packed=packed)
    g = group(samples=3, traces=6)
    limit = max(len(encode(t)) for t in g.trajectories) // 2  # no member fits a part whole
    parts = split_record(g, limit, packed=packed)
    check_parts(g, parts, limit, packed)
    pieces = [(t.sample_index, t.part, t.parts, a) for p, _ in parts for t, a in zip(p.trajectories, p.advantages)]
    assert {(i, a) for i, _, _, a in pieces} == {(t.sample_index, a) for t, a in zip(g.trajectories, g.advantages)}
    assert all(n > 1 for _, _, n, _ in pieces)  # every member split, each piece trains with its member's advantage


@both
@pytest.mark.parametrize("record", [group(), trajectory(0)], ids=["group", "trajectory"])
def test_a_trace_too_large_for_any_part_is_refused(record, packed):
    encode = partial(globals()["encode"], packed=packed)
    largest = max(len(encode(tr)) for t in getattr(record, "trajectories", [record]) for tr in t.traces)
    with pytest.raises(RecordTooLarge, match="one trace alone"):
        split_record(record, largest, packed=packed)


@both
def test_reader_joins_parts_in_any_order_and_passes_whole_records_through(packed):
    encode = partial(globals()["encode"], packed=packed)
    g, t = group(), trajectory(3, traces=6)
    parts = [p for p, _ in split_record(g, len(encode(g)) // 2, packed=packed)] + \
        [p for p, _ in split_record(t, len(encode(t)) // 2, packed=packed)]
    joiner = Parts()
    other = group(seed=1)
    assert joiner.add(other) is other
    random.Random(3).shuffle(parts)
    got = [w for w in map(joiner.add, parts) if w is not None]
    assert sorted(encode(w) for w in got) == sorted([encode(g), encode(t)])


@pytest.mark.parametrize("fields, problem", [({"part": 2, "parts": 2, "part_of": "x"}, "below the count"),
                                             ({"parts": 2}, "part_of"), ({"part_of": "x"}, "part_of")])
@pytest.mark.parametrize("record", [group(samples=1), trajectory(0)], ids=["group", "trajectory"])
def test_inconsistent_part_fields_do_not_decode(record, fields, problem):
    with pytest.raises(RecordDecodeError, match=problem):
        decode(encode(record.model_copy(update=fields)), type(record))
