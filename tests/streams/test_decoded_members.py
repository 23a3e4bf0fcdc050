"""The group stage's cache of decoded members: hits only on the exact bytes, bounded by their size."""

from __future__ import annotations

from schemas import Trajectory, decode, encode
from streams.group_agent import Decoded


def _member(i: int, pad: int = 0) -> tuple[bytes, Trajectory]:
    traj = Trajectory(session_id=f"s{i}", group_id="g", sample_index=i, metrics={"pad": float(pad)},
                      harness="x" * pad)
    raw = encode(traj)
    return raw, decode(raw, Trajectory)


def test_a_hit_needs_the_same_bytes():
    cache = Decoded()
    raw, traj = _member(0)
    cache.put("g/0", raw, traj)
    assert cache.get("g/0", bytes(raw)) is traj  # equal bytes (a table may hand back a copy)
    other, _ = _member(1)
    assert cache.get("g/0", other) is None  # another attempt's bytes under the same key
    assert cache.get("g/1", other) is None


def test_bounded_by_bytes_least_recently_used_first():
    members = [_member(i, pad=1000) for i in range(3)]
    size = len(members[0][0])
    cache = Decoded(max_bytes=2 * size + size // 2)  # room for two
    cache.put("g/0", *members[0])
    cache.put("g/1", *members[1])
    assert cache.get("g/0", members[0][0]) is not None  # g/0 is now the most recent
    cache.put("g/2", *members[2])
    assert cache.get("g/1", members[1][0]) is None  # evicted
    assert cache.get("g/0", members[0][0]) is not None and cache.get("g/2", members[2][0]) is not None
    assert cache.bytes == len(members[0][0]) + len(members[2][0])
    cache.pop("g/0")
    cache.pop("g/0")  # twice is harmless
    assert cache.bytes == len(members[2][0])
    cache.put("g/2", *members[2])  # replacing does not count twice
    assert cache.bytes == len(members[2][0])
    tiny = Decoded(max_bytes=10)
    tiny.put("g/0", *members[0])  # larger than the whole budget: not kept
    assert tiny.bytes == 0 and tiny.get("g/0", members[0][0]) is None
