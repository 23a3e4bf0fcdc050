"""sft_select: the rule over recorded trajectories, and best-of-group's wait for whole groups."""

from schemas import Trace, Trajectory
from trainer.sft_select import Row, Rule, Selector


def _traj(group, i, reward, n=2, task_set="default", usable=True, part=0, parts=1, part_of=""):
    trace = Trace(call_indices=[0], token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0, -1, -1])
    return Trajectory(session_id=f"{group}-{i}", group_id=group, sample_index=i, num_samples=n, reward=reward,
                      task_set=task_set, usable=usable, traces=[trace], part=part, parts=parts, part_of=part_of)


def _rows(trajs):
    return [Row.of(0, k, t.event_id.encode(), t) for k, t in enumerate(trajs)]


def _decide(rule, rows):
    sel = Selector(rule)
    out = [d for r in rows for d in sel.add(r)]
    return out, sel


def test_min_reward_task_set_and_unusable_rows_are_dropped_with_their_reason():
    rows = _rows([_traj("a", 0, 1.0), _traj("a", 1, 0.5), _traj("b", 0, 1.0, task_set="other"),
                  _traj("b", 1, 1.0, usable=False)])
    out, sel = _decide(Rule(min_reward=1.0, task_sets=("default",)), rows)
    assert [(d.row.offset, d.keep, d.reason) for d in out] == [
        (0, True, ""), (1, False, "reward"), (2, False, "task_set"), (3, False, "unusable")]
    assert sel.pending == []


def test_best_of_group_waits_for_the_whole_group_then_keeps_its_best():
    rows = _rows([_traj("a", 0, 0.0), _traj("b", 0, 1.0), _traj("a", 1, 1.0), _traj("b", 1, 1.0)])
    sel = Selector(Rule(best_of_group=True))
    assert sel.add(rows[0]) == [] and sel.add(rows[1]) == []
    assert {r.offset for r in sel.pending} == {0, 1}  # undecided: what a checkpoint must name
    a = sel.add(rows[2])
    assert [(d.row.offset, d.keep, d.reason) for d in a] == [(0, False, "not_best"), (2, True, "")]
    b = sel.add(rows[3])  # a tie: the lower sample index wins
    assert [(d.row.offset, d.keep) for d in b] == [(1, True), (3, False)]
    assert sel.pending == []


def test_best_of_group_keeps_every_part_of_the_best_trajectory_and_flushes_open_groups_at_the_end():
    whole = _traj("a", 1, 1.0)
    parts = [_traj("a", 1, 1.0, part=k, parts=2, part_of=whole.event_id) for k in range(2)]
    rows = _rows([_traj("a", 0, 0.5), parts[0], parts[1], _traj("c", 0, 0.0, n=4)])
    out, sel = _decide(Rule(best_of_group=True, min_reward=0.5), rows[:2])
    assert out == []  # the best trajectory has one part of two: the group is not complete
    out = sel.add(rows[2])
    assert [(d.row.offset, d.keep) for d in out] == [(0, False), (1, True), (2, True)]
    sel.add(rows[3])
    flushed = sel.flush()  # the input ended with group c open: decided with what it has (below min_reward)
    assert [(d.row.offset, d.keep, d.reason) for d in flushed] == [(3, False, "reward")]


def test_an_undecodable_row_is_dropped_not_fatal():
    out, _ = _decide(Rule(), [Row.of(0, 7, b"{bad", None, "not json")])
    assert [(d.row.offset, d.keep, d.reason) for d in out] == [(7, False, "undecodable")]
