"""Config strictness, step selection (dedupe, staleness, zero variance), lr schedule, the run log."""

import pytest

from tests.plugins.trainer import make_group
from trainer.config import ConfigError, TrainConfig
from trainer.kafka_io import Polled
from trainer.metrics import effective_steps
from trainer.optim import lr_at
from trainer.selection import SeenIds, group_version, plan_step, staleness_weight


def test_config_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ConfigError, match="unknown trainer setting 'lrr'"):
        TrainConfig.from_overrides({"lrr": 1})
    with pytest.raises(ConfigError, match="groups_per_step='many'"):
        TrainConfig.from_overrides({"groups_per_step": "many"})
    with pytest.raises(ConfigError, match="loss_norm='mean'.*token_mean"):
        TrainConfig.from_overrides({"loss_norm": "mean"})
    with pytest.raises(ConfigError, match="clip_low"):
        TrainConfig.from_overrides({"clip_low": "1.5"})
    with pytest.raises(ConfigError, match="engines"):
        TrainConfig.from_overrides({"engines": "sglang=http://x"})
    cfg = TrainConfig.from_overrides({"lr": "3e-4", "progress": "false", "engines": "polar=http://a:1,vllm=http://b:2"})
    assert cfg.lr == 3e-4 and cfg.progress is False and cfg.engines == ["polar=http://a:1", "vllm=http://b:2"]


def _polled(groups):
    return [Polled("t", 0, i, g) for i, g in enumerate(groups)]


def test_plan_dedupes_drops_stale_and_skips_zero_variance():
    fresh, old = make_group("a", [[1], [2]], [1.0, 0.0], policy_version=9), make_group("b", [[1], [2]], [1.0, 0.0])
    flat = make_group("c", [[1], [2]], [1.0, 1.0], policy_version=10)
    bad = Polled("t", 1, 7, None, "TrainingGroup: not valid JSON")
    seen = SeenIds()
    plan = plan_step([*_polled([fresh, fresh, old, flat]), bad], seen, served_version=10,
                     cfg=TrainConfig(max_staleness=4))
    assert [c.group.group_id for c in plan.chosen] == ["a"] and plan.staleness == [1]
    assert [s["reason"] for s in plan.skipped] == ["duplicate", "stale", "zero_variance", "undecodable"]
    assert plan.skipped[3]["offset"] == 7 and "not valid JSON" in plan.skipped[3]["error"]
    assert plan_step(_polled([fresh]), seen, 10, TrainConfig()).skipped[0]["reason"] == "duplicate"  # across steps


def test_a_group_re_emitted_under_a_new_event_id_trains_once():
    first = make_group("a", [[1], [2]], [1.0, 0.0])
    again = make_group("a", [[1], [3]], [0.0, 1.0])  # a restarted stream worker rebuilt it: new event id
    assert first.event_id != again.event_id
    seen = SeenIds()
    plan = plan_step(_polled([first, again]), seen, 0, TrainConfig())
    assert [c.group.event_id for c in plan.chosen] == [first.event_id]
    assert [(s["event_id"], s["reason"]) for s in plan.skipped] == [(again.event_id, "duplicate_group")]
    # across steps and across a restart (the window is checkpointed as SeenIds.to_list())
    later = make_group("a", [[4], [5]], [1.0, 0.0])
    restored = SeenIds(seen.to_list())
    assert plan_step(_polled([later]), restored, 0, TrainConfig()).skipped[0]["reason"] == "duplicate_group"
    assert plan_step(_polled([make_group("b", [[1], [2]], [1.0, 0.0])]), seen, 0, TrainConfig()).chosen


def test_each_part_of_a_group_sent_in_parts_trains_once():
    from schemas import encode, split_record

    whole = make_group("a", [[1] * 50, [2] * 50, [3] * 50], [1.0, 0.0, 0.25])
    parts = [p for p, _ in split_record(whole, len(encode(whole)) // 2)]
    assert len(parts) >= 2
    seen = SeenIds()
    plan = plan_step(_polled([parts[0], *parts, parts[-1]]), seen, 0, TrainConfig())  # re-delivered ones, too
    assert [c.group.event_id for c in plan.chosen] == [p.event_id for p in parts]
    assert [s["reason"] for s in plan.skipped] == ["duplicate", "duplicate"]
    trained = [t.sample_index for c in plan.chosen for t in c.group.trajectories]
    assert trained == [t.sample_index for t in whole.trajectories]
    assert plan_step(_polled([whole]), seen, 0, TrainConfig()).chosen  # unsplit, it is another entry


def test_staleness_counts_from_the_served_version():
    """Groups sampled by the version the engines serve are fresh, however far training got past it."""
    g = make_group("a", [[1], [2]], [1.0, 0.0], policy_version=3)
    cfg = TrainConfig(max_staleness=0)
    assert plan_step(_polled([g]), SeenIds(), served_version=3, cfg=cfg).staleness == [0]
    assert plan_step(_polled([g]), SeenIds(), served_version=2, cfg=cfg).staleness == [0]  # newer than we knew
    assert plan_step(_polled([g]), SeenIds(), served_version=5, cfg=cfg).skipped[0]["staleness"] == 2


def test_downweighting_decays_with_versions_over_the_bound():
    cfg = TrainConfig(max_staleness=2, stale_mode="downweight", stale_weight=0.5)
    assert [staleness_weight(s, cfg) for s in (0, 2, 3, 5)] == [1.0, 1.0, 0.5, 0.125]
    assert staleness_weight(3, TrainConfig(max_staleness=2)) == 0.0
    plan = plan_step(_polled([make_group("a", [[1], [2]], [1.0, 0.0])]), SeenIds(), 4, cfg)
    assert [(c.staleness, c.weight) for c in plan.chosen] == [(4, 0.25)]


def test_group_version_is_the_oldest_sampler():
    g = make_group("a", [[1], [2]], [1.0, 0.0], policy_version=5)
    g.trajectories[1].traces[0].policy_versions = [3, 6]
    assert group_version(g) == 3


def test_seen_ids_are_bounded():
    seen = SeenIds(limit=2)
    for i in "abc":
        seen.add(i)
    assert "a" not in seen and seen.to_list() == ["b", "c"]


def test_lr_schedule():
    cfg = TrainConfig(lr=1.0, warmup_steps=1, lr_schedule="cosine", min_lr=0.1, max_steps=11)
    assert lr_at(0, cfg) == 0.5 and lr_at(1, cfg) == 1.0
    assert lr_at(6, cfg) == pytest.approx(0.55) and lr_at(11, cfg) == 0.1
    assert lr_at(500, TrainConfig(lr=2e-6)) == 2e-6  # constant by default


def test_effective_steps_drop_work_lost_in_a_crash():
    log = [{"event": "start", "step": 0}, *({"event": "step", "step": i} for i in (1, 2, 3)),
           {"event": "start", "step": 2}, {"event": "step", "step": 3}, {"event": "step", "step": 4}]
    assert [s["step"] for s in effective_steps(log)] == [1, 2, 3, 4]


def test_held_out_task_sets_are_consumed_but_never_trained():
    train, held = make_group("t", [[1], [2]], [1.0, 0.0]), make_group("h", [[1], [2]], [1.0, 0.0])
    held = held.model_copy(update={"trajectories": [t.model_copy(update={"task_set": "demo-heldout"})
                                                    for t in held.trajectories]})
    plan = plan_step(_polled([train, held]), SeenIds(), served_version=0,
                     cfg=TrainConfig(skip_task_sets=["demo-heldout"]))
    assert [c.group.group_id for c in plan.chosen] == ["t"]
    assert [(s["group_id"], s["reason"]) for s in plan.skipped] == [("h", "eval_only")]
    # without the setting the same group trains
    assert len(plan_step(_polled([held]), SeenIds(), served_version=0, cfg=TrainConfig()).chosen) == 1


def test_a_group_without_signal_is_dropped_when_its_task_asks_and_masked_otherwise():
    """With skip_zero_variance off (the driver's runs), a flat group closes its step masked, unless its task
    said ``zero_signal: drop`` (the driver then sends another in its place); a group with signal always trains."""
    def asking(group, wish):
        return group.model_copy(update={"trajectories": [t.model_copy(update={"zero_signal": wish}) for t in group.trajectories]})

    flat_mask, flat_drop = make_group("m", [[1], [2]], [1.0, 1.0]), asking(make_group("d", [[1], [2]], [0.0, 0.0]), "drop")
    signal_drop = asking(make_group("s", [[1], [2]], [1.0, 0.0]), "drop")
    plan = plan_step(_polled([flat_mask, flat_drop, signal_drop]), SeenIds(), served_version=0,
                     cfg=TrainConfig(skip_zero_variance=False))
    assert [c.group.group_id for c in plan.chosen] == ["m", "s"]
    assert [(s["group_id"], s["reason"]) for s in plan.skipped] == [("d", "zero_variance")]
