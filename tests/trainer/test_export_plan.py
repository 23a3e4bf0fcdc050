"""How an export splits the tensors into shard files (trainer/export.py shard_plan): every tensor once and
in order, at least one file per rank (every rank writes), balanced by bytes, none over the cap."""

from __future__ import annotations

import pytest

from trainer.export import shard_plan


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_every_tensor_once_in_order_one_file_per_rank_at_least(world):
    sizes = {f"layers.{i}.w": 1000 + 37 * (i % 5) for i in range(40)}
    plan = shard_plan(sizes, world)
    assert [n for f in plan for n in f] == list(sizes)
    assert len(plan) == world
    loads = [sum(sizes[n] for n in f) for f in plan]
    assert max(loads) <= 1.3 * sum(loads) / len(plan)  # balanced by bytes


def test_the_cap_adds_files_and_one_huge_tensor_stands_alone():
    sizes = {"embed": 9_000, **{f"l{i}": 1_000 for i in range(6)}}
    plan = shard_plan(sizes, 1, max_bytes=4_000)
    assert [n for f in plan for n in f] == list(sizes)
    assert plan[0] == ["embed"] and all(sum(sizes[n] for n in f) <= 4_000 for f in plan[1:])


def test_fewer_tensors_than_ranks_gives_one_file_each():
    assert shard_plan({"a": 10, "b": 10}, 4) == [["a"], ["b"]]
