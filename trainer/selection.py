"""Which consumed groups a step trains on: dedupe, staleness, zero variance. Pure functions."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from schemas import TrainingGroup

from .config import TrainConfig
from .kafka_io import Polled


class SeenIds:
    """The event ids and group ids (``group_key``) of the newest consumed groups, in order: at most
    ``limit`` ids (bounded memory, checkpointed).

    At-least-once upstream may deliver a group twice (same event id), and a stream worker that restarts
    may emit a group again under a new event id (same group id); either seen within the window is skipped.
    """

    def __init__(self, ids: Iterable[str] = (), limit: int = 100_000):
        self.limit = limit
        self._ids: OrderedDict[str, None] = OrderedDict((i, None) for i in ids)

    def __contains__(self, event_id: str) -> bool:
        return event_id in self._ids

    def add(self, event_id: str) -> None:
        self._ids[event_id] = None
        while len(self._ids) > self.limit:
            self._ids.popitem(last=False)

    def to_list(self) -> list[str]:
        return list(self._ids)


@dataclass
class Chosen:
    group: TrainingGroup
    staleness: int
    weight: float


@dataclass
class StepPlan:
    chosen: list[Chosen] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # {"event_id", "group_id", "reason", ...}

    @property
    def staleness(self) -> list[int]:
        return [c.staleness for c in self.chosen]


def group_version(group: TrainingGroup) -> int | None:
    """The oldest policy version that sampled any part of the group (None when unrecorded)."""
    versions = list(group.policy_versions)
    for traj in group.trajectories:
        for trace in traj.traces:
            versions.extend(trace.policy_versions)
    return min(versions) if versions else None


def staleness_weight(staleness: int, cfg: TrainConfig) -> float:
    """1 within the bound; beyond it 0 (drop) or stale_weight ** (versions over the bound)."""
    if staleness <= cfg.max_staleness:
        return 1.0
    if cfg.stale_mode == "drop":
        return 0.0
    return math.pow(cfg.stale_weight, staleness - cfg.max_staleness)


def group_key(group: TrainingGroup) -> str:
    """A group's entry in SeenIds (prefixed: event ids are hex digests, group ids anything); each part
    of a group sent in parts (schemas/parts.py) trains once, as its own entry."""
    return f"group:{group.group_id}" if group.parts == 1 else f"group:{group.group_id}#{group.part}/{group.parts}"


def plan_step(polled: Sequence[Polled], seen: SeenIds, served_version: int, cfg: TrainConfig) -> StepPlan:
    """Decide for each consumed message whether it trains this step and with what weight.

    Staleness is counted against ``served_version``, the policy version the engines last loaded (see
    trainer/sync/syncer.py): data sampled by the served policy is fresh even when later weight syncs failed.
    Every message is accounted for: chosen, or skipped with a reason. ``seen`` is updated.
    """
    plan = StepPlan()
    for p in polled:
        where = {"partition": p.partition, "offset": p.offset}
        if p.group is None:
            plan.skipped.append({"event_id": "", "group_id": "", "reason": "undecodable", "error": p.error, **where})
            continue
        g = p.group
        info = {"event_id": g.event_id, "group_id": g.group_id, **where}
        if g.event_id in seen:
            plan.skipped.append({**info, "reason": "duplicate"})
            continue
        seen.add(g.event_id)
        if g.group_id:  # a group emits once: another record of it (new event id) is a re-emission
            if group_key(g) in seen:
                plan.skipped.append({**info, "reason": "duplicate_group"})
                continue
            seen.add(group_key(g))
        version = group_version(g)
        staleness = max(0, served_version - version) if version is not None else 0
        weight = staleness_weight(staleness, cfg)
        if weight == 0.0:
            plan.skipped.append({**info, "reason": "stale", "staleness": staleness})
        elif not g.trajectories or not any(t.traces for t in g.trajectories):
            plan.skipped.append({**info, "reason": "empty"})
        elif cfg.skip_task_sets and any(t.task_set in cfg.skip_task_sets for t in g.trajectories):
            plan.skipped.append({**info, "reason": "eval_only"})  # a held-out set: evaluated, never trained on
        elif g.no_signal and not cfg.distill_url and (
                cfg.skip_zero_variance or any(t.zero_signal == "drop" for t in g.trajectories)):
            # (with a teacher, a group whose rewards tie still has its per-token signal: trainer/distill.py)
            # skipped trainer-wide, or by its task's wish (the driver replaces it: polarstream/driver/schedule.py)
            plan.skipped.append({**info, "reason": "zero_variance"})
        else:
            plan.chosen.append(Chosen(g, staleness, weight))
    return plan
