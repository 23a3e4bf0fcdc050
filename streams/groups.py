"""Gathering a group's trajectories and deciding when it is ready to train (pure functions).

The group's state is small (one reference per sample); the trajectories themselves live under their
own keys so that each update of the state stays a few hundred bytes on the changelog. A group emits
once: when every sample is in, or at its deadline with at least ``min_valid`` usable members. A later
attempt of a sample (a retried session) replaces the earlier one while the group is still open.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas import TrainingGroup, Trajectory, derived_event_id

from .advantages import compute_advantages, overlong_penalty
from .config import StreamsConfig


@dataclass
class MemberRef:
    session_id: str
    attempt: int
    event_id: str
    usable: bool


@dataclass
class GroupState:
    group_id: str
    task_id: str
    num_samples: int
    min_valid: int
    first_seen: float
    partition: int
    members: dict[int, MemberRef] = field(default_factory=dict)  # sample_index -> current member
    emitted: str = ""  # the TrainingGroup's event id, or "dropped:<reason>"; set once
    closed_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("group_id", "task_id", "num_samples", "min_valid", "first_seen",
                                            "partition", "emitted", "closed_at")}
        d["members"] = {str(k): vars(v).copy() for k, v in self.members.items()}
        return d

    @classmethod
    def from_json(cls, o: dict[str, Any]) -> "GroupState":
        members = {int(k): MemberRef(**v) for k, v in o["members"].items()}
        return cls(**{**o, "members": members})

    @property
    def usable(self) -> int:
        return sum(m.usable for m in self.members.values())


def new_group(traj: Trajectory, now: float, partition: int) -> GroupState:
    """Empty state for the group of ``traj``, first seen at ``now`` on ``partition``."""
    return GroupState(traj.group_id, traj.task_id, traj.num_samples, traj.min_valid, now, partition)


def add_member(state: GroupState, traj: Trajectory) -> str:
    """Record a trajectory in the group's state, in place. Returns what happened:

    ``added``, ``replaced`` (a later attempt of the sample), ``duplicate`` (same event id),
    ``stale_attempt`` (an earlier attempt than the one held), ``conflict`` (same attempt, different
    content: kept the first), or ``late`` (the group already emitted or was dropped).
    """
    if state.emitted:
        return "late"
    held = state.members.get(traj.sample_index)
    ref = MemberRef(traj.session_id, traj.attempt, traj.event_id, traj.usable)
    if held is None:
        state.members[traj.sample_index] = ref
        return "added"
    if held.event_id == traj.event_id:
        return "duplicate"
    if traj.attempt > held.attempt:
        state.members[traj.sample_index] = ref
        return "replaced"
    return "stale_attempt" if traj.attempt < held.attempt else "conflict"


def due(state: GroupState, config: StreamsConfig) -> tuple[str, float]:
    """The group's next action ('emit' or 'drop:<reason>') and the time from which it applies
    (``-inf``: at once); ``('', inf)`` once it emitted or was dropped. A group emits when every sample
    is in, or at its deadline with at least ``min_valid`` usable members; it is dropped at
    ``group_expire_s`` if it never gets there. Live agent and replay both ask this (see sessions.due)."""
    if state.emitted:
        return "", float("inf")
    enough = state.usable >= state.min_valid
    if len(state.members) >= state.num_samples:
        return ("emit" if enough else "drop:too_few_usable"), float("-inf")
    deadline, expire = state.first_seen + config.group_deadline_s, state.first_seen + config.group_expire_s
    return ("emit", deadline) if enough and deadline <= expire else ("drop:expired", expire)


def decide(state: GroupState, now: float, config: StreamsConfig) -> str:
    """'' (keep waiting), 'emit', or 'drop:<reason>' for an open group at time ``now`` (see ``due``)."""
    action, at = due(state, config)
    return action if now >= at else ""


def group_id_for(group_id: str, members: Sequence[Trajectory], config: StreamsConfig) -> str:
    """Deterministic event id of the TrainingGroup built from these members."""
    ordered = sorted(members, key=lambda t: t.sample_index)
    return derived_event_id("group", group_id, *(t.event_id for t in ordered), config.group_fingerprint())


def build_group(group_id: str, members: Sequence[Trajectory], config: StreamsConfig,
                masked_reasons: dict[str, str] | None = None) -> TrainingGroup | None:
    """The TrainingGroup of these members, or None when config drops a zero-variance group.

    Unusable members are listed in ``masked`` and kept out of the baseline and std; ``masked_reasons``
    says why, where the caller knows (a judge failure's class).
    """
    ordered = sorted(members, key=lambda t: t.sample_index)
    usable = [t for t in ordered if t.usable]
    if not usable:
        raise ValueError(f"group {group_id}: no usable member to train on")
    rewards = [t.reward + overlong_penalty(sum(sum(tr.loss_mask) for tr in t.traces), config.overlong_max_tokens,
                                           config.overlong_buffer, config.overlong_penalty) for t in usable]
    adv = compute_advantages(rewards, config.baseline, config.std_normalized, config.epsilon)
    if adv.zero_variance and config.zero_variance == "drop":
        return None
    versions = sorted({v for t in usable for tr in t.traces for v in tr.policy_versions})
    return TrainingGroup(
        event_id=group_id_for(group_id, ordered, config),
        created_at=max(t.created_at for t in ordered),
        group_id=group_id,
        task_id=ordered[0].task_id,
        trajectories=usable,
        advantages=adv.values,
        masked=[t.session_id for t in ordered if not t.usable],
        masked_reasons=dict(sorted((masked_reasons or {}).items())),
        baseline=config.baseline,
        std_normalized=config.std_normalized,
        zero_variance=adv.zero_variance,
        reward_mean=adv.mean,
        reward_std=adv.std,
        policy_versions=versions,
    )
