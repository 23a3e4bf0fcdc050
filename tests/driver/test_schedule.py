"""The driver's schedule (polarstream/driver/schedule.py): bounded asynchrony and evals pinned to one version."""

from __future__ import annotations

import pytest

from polarstream.driver.schedule import Schedule


def simulate(schedule: Schedule) -> list[tuple]:
    """Run the schedule against an idealized system: every submitted step's groups come back at once, the
    trainer trains one step per tick in order, an eval finishes the tick after it goes out. Returns the
    events: ("submit", step, served version), ("eval", version), ("train", new version)."""
    events, submitted, served, evaluated, evaluating = [], 0, 0, set(), set()
    for _ in range(10 * schedule.steps + 10):
        for v in list(evaluating):  # evals out last tick are in
            evaluating.discard(v)
            evaluated.add(v)
        if (v := schedule.due_eval(served, evaluated, evaluating)) is not None:
            evaluating.add(v)
            events.append(("eval", v))
        for k in schedule.due_steps(submitted, served, evaluated):
            events.append(("submit", k, served))
            submitted = k + 1
        if served < submitted and not evaluating:  # the trainer trains the oldest submitted step
            served += 1
            events.append(("train", served))
        if served == schedule.steps and evaluated >= set(schedule.eval_versions()):
            return events
    raise AssertionError(f"stuck: {events}")


def test_s0_is_the_on_policy_loop():
    events = simulate(Schedule(steps=3))
    assert events == [("eval", 0), ("submit", 0, 0), ("train", 1), ("submit", 1, 1), ("train", 2), ("submit", 2, 2),
                      ("train", 3), ("eval", 3)]


@pytest.mark.parametrize("s", [1, 2, 3])
def test_at_most_s_plus_1_steps_are_in_flight_and_none_is_sampled_more_than_s_behind(s):
    events = simulate(Schedule(steps=8, async_level=s, evaluate=False))
    subs = [e for e in events if e[0] == "submit"]
    assert [e[1] for e in subs] == list(range(8))
    assert all(step - served <= s for _, step, served in subs)  # step k trains into k+1; sampled at >= k-S
    assert any(step - served == s for _, step, served in subs)  # and the bound is used, not just respected
    in_flight, served = 0, 0
    for e in events:
        in_flight += e[0] == "submit"
        in_flight -= e[0] == "train"
        assert in_flight <= s + 1


def test_an_eval_is_a_barrier_pinned_to_its_version():
    sched = Schedule(steps=6, async_level=2, eval_every=2)
    assert sched.eval_versions() == [0, 2, 4, 6]
    events = simulate(sched)
    for v in (0, 2, 4):
        at = events.index(("eval", v))
        assert not [e for e in events[at:] if e[0] == "train" and e[1] == v + 1 and events.index(e) < at]
        # no step that trains past v went out before v's eval
        assert all(e[1] < v for e in events[:at] if e[0] == "submit")
        assert ("train", v) in events[:at] or v == 0
    assert events[-1] == ("eval", 6)


def test_no_eval_when_there_is_no_eval_split():
    sched = Schedule(steps=2, evaluate=False)
    assert sched.eval_versions() == [] and list(sched.due_steps(0, 0, set())) == [0]


def test_step_batches_are_the_demos_draws_and_the_same_on_every_start():
    import random

    from polarstream.driver.schedule import step_batches

    tasks = [f"q{i}" for i in range(13)]
    order = random.Random(5)  # the demo's draws before resume existed: one stream, tasks_per_step a step
    assert step_batches(tasks, 5, 6, 4) == [[order.choice(tasks) for _ in range(4)] for _ in range(6)]
    assert step_batches(tasks, 5, 6, 4) == step_batches(tasks, 5, 6, 4) != step_batches(tasks, 6, 6, 4)


def test_submitted_reads_a_runs_steps_and_evals_back_from_its_task_ids():
    from polarstream.driver.schedule import eval_tag, step_tag, submitted, task_id

    ids = [task_id("arith-1", step_tag(0), i) for i in range(4)] + [task_id("arith-1", step_tag(1), 2)]
    ids += [task_id("arith-1", eval_tag(0), i) for i in range(3)]
    ids += [task_id("arith-12", step_tag(5), 0), task_id("arith", step_tag(6), 0), "arith-1-s007", "other"]
    steps, evals = submitted("arith-1", ids)
    assert steps == {0: {0, 1, 2, 3}, 1: {2}} and evals == {0: {0, 1, 2}}


def test_epochs_train_every_task_once_an_epoch_in_a_seeded_shuffle():
    from collections import Counter

    from polarstream.driver.schedule import epoch_steps, step_batches

    tasks = [f"q{i}" for i in range(10)]
    steps = epoch_steps(len(tasks), 4, 3)  # 30 tasks, 4 a step: 8 steps, the last into a 4th epoch
    assert steps == 8
    batches = step_batches(tasks, 7, steps, 4, order="epochs")
    stream = [t for b in batches for t in b]
    assert all(len(b) == 4 for b in batches) and len(stream) == 32
    for e in range(3):  # each epoch: every task exactly once
        assert Counter(stream[e * 10:(e + 1) * 10]) == Counter(tasks)
    assert stream[:10] != stream[10:20] != stream[20:30]  # shuffled again each epoch
    assert step_batches(tasks, 7, steps, 4, order="epochs") == batches != step_batches(tasks, 8, steps, 4, order="epochs")
    with pytest.raises(ValueError, match="order"):
        step_batches(tasks, 7, 1, 4, order="sorted")


@pytest.mark.parametrize("per_step,cap", [(4, 0), (4, 2), (2, 8)])
@pytest.mark.parametrize("flat_share", [0.0, 0.5, 1.0])
def test_drop_and_replace_always_closes_a_step_with_its_groups_and_at_most_per_step_plus_cap_more(per_step, cap, flat_share):
    """The trainer drops a flat group exactly when its task's wish says so; the driver sends one replacement
    per such drop. Whatever comes back flat, the step ends with ``per_step`` trained groups (the trainer's
    count) after at most per_step + cap replacements, and replacement draws are a function of seed, step, j."""
    import random

    from polarstream.driver.schedule import replacement, replacements_due, zero_signal_wish

    rng = random.Random(f"{per_step}:{cap}:{flat_share}")
    flat: set[int] = set()
    sent = per_step
    for i in range(10 * (per_step + cap) + 10):  # groups come back in the order they went out
        if i == sent:
            break
        if rng.random() < flat_share:
            flat.add(i)
        sent = max(sent, per_step + replacements_due(flat, per_step, cap))
    else:
        raise AssertionError("the step never closed")
    trained = [i for i in range(sent) if not (i in flat and zero_signal_wish(i, per_step, cap) == "drop")]
    assert len(trained) == per_step
    assert sent - per_step <= per_step + cap
    if flat_share == 1.0:  # all flat: every droppable one replaced, the last per_step masked
        assert sent - per_step == per_step + cap and all(zero_signal_wish(i, per_step, cap) == "mask" for i in trained)
    tasks = [f"t{i}" for i in range(50)]
    assert replacement(tasks, 3, 5, 1) == replacement(tasks, 3, 5, 1)
    assert len({replacement(tasks, 3, 5, j) for j in range(20)}) > 1


def test_a_task_is_retired_after_its_last_groups_were_all_solved_or_all_unsolved():
    from polarstream.driver.schedule import outcome, retired

    assert [outcome(r) for r in ([1, 1], [0, 0], [1, 0], [])] == ["solved", "unsolved", "mixed", "mixed"]
    history = {"easy": ["mixed", "solved", "solved"], "hard": ["unsolved", "unsolved"], "back": ["solved", "mixed"],
               "once": ["solved"]}
    assert retired(history, "both", 2) == {"easy", "hard"}
    assert retired(history, "solved", 2) == {"easy"} and retired(history, "unsolved", 2) == {"hard"}
    assert retired(history, "solved", 1) == {"easy", "once"}  # "back" was solved, then not: it stays
    assert retired(history, "none", 1) == set()


def test_the_curriculum_skips_retired_tasks_draws_the_same_steps_again_and_never_leaves_a_step_short():
    from polarstream.driver.schedule import Curriculum, step_batches

    tasks = [f"t{i}" for i in range(6)]
    plain = Curriculum(tasks, 4, "epochs", 4, key=str)
    assert [plain.draw(set()) for _ in range(3)] == step_batches(tasks, 4, 3, 4, "epochs")  # nothing retired: the same
    gone = [set(), {"t1", "t2"}, {"t1", "t2", "t5"}, set(tasks)]
    first, again = Curriculum(tasks, 4, "epochs", 4, key=str), Curriculum(tasks, 4, "epochs", 4, key=str)
    drawn = [first.draw(g) for g in gone]
    assert drawn == [again.draw(g) for g in gone]  # a restart that replays the retired sets draws the same
    for batch, g in zip(drawn, gone):
        assert len(batch) == 4 and (not set(batch) & g or g == set(tasks))
    assert drawn[0] == step_batches(tasks, 4, 1, 4, "epochs")[0]
