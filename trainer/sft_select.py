"""Which recorded trajectories ``polarstream sft`` trains on: a rule over rows of polar.trajectories.

A row is one Kafka message of polar.trajectories (a Trajectory, or one part of one: schemas/parts.py).
The rule keeps rows that are usable, reach ``min_reward`` and belong to one of ``task_sets`` (empty: any);
with ``best_of_group`` only the highest-reward trajectory of each group is kept (ties: the lowest
sample_index), which needs the whole group: its rows wait in ``Selector`` until the group is complete
(``num_samples`` trajectories, every part of each) or the input ends.

Pure and position-aware: every row carries its (partition, offset), and ``Selector.pending`` lists the rows
taken but not yet decided, so a checkpoint can name exactly what a restart must read again.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from schemas import Trajectory


@dataclass(frozen=True)
class Rule:
    min_reward: float | None = None  # None: any reward
    best_of_group: bool = False
    task_sets: tuple[str, ...] = ()  # empty: any task set

    def admits(self, t: Trajectory) -> str:
        """'' when a trajectory passes the per-row tests, else why not."""
        if not t.usable:
            return "unusable"
        if self.task_sets and t.task_set not in self.task_sets:
            return "task_set"
        if self.min_reward is not None and t.reward < self.min_reward:
            return "reward"
        return ""


@dataclass(frozen=True)
class Row:
    """One message: its position, the sha256 of its bytes (what the resume test compares) and the record,
    or why it did not decode."""

    partition: int
    offset: int
    digest: str
    traj: Trajectory | None
    error: str = ""

    @staticmethod
    def of(partition: int, offset: int, value: bytes, traj: Trajectory | None, error: str = "") -> "Row":
        return Row(partition, offset, hashlib.sha256(value or b"").hexdigest(), traj, error)

    @property
    def whole_id(self) -> str:
        """The trajectory this row belongs to (parts share it)."""
        return (self.traj.part_of or self.traj.event_id) if self.traj else ""


@dataclass
class Decision:
    row: Row
    keep: bool
    reason: str = ""  # why dropped


@dataclass
class _Group:
    rows: list[Row] = field(default_factory=list)
    num_samples: int = 1

    def complete(self) -> bool:
        parts: dict[str, set[int]] = {}
        wanted: dict[str, int] = {}
        samples = set()
        for r in self.rows:
            parts.setdefault(r.whole_id, set()).add(r.traj.part)
            wanted[r.whole_id] = r.traj.parts
            samples.add(r.traj.sample_index)
        return len(samples) >= self.num_samples and all(len(parts[k]) >= wanted[k] for k in parts)


class Selector:
    """Rows in, decisions out (in the order they become final)."""

    def __init__(self, rule: Rule):
        self.rule = rule
        self._groups: dict[str, _Group] = {}

    def add(self, row: Row) -> list[Decision]:
        if row.traj is None:
            return [Decision(row, False, "undecodable")]
        if not self.rule.best_of_group:
            why = self.rule.admits(row.traj)
            return [Decision(row, not why, why)]
        g = self._groups.setdefault(row.traj.group_id, _Group())
        g.rows.append(row)
        g.num_samples = max(g.num_samples, row.traj.num_samples)
        if not g.complete():
            return []
        return self._close(row.traj.group_id)

    def flush(self) -> list[Decision]:
        """The input ended: decide every open group with what it has (oldest first)."""
        out = []
        for gid in list(self._groups):
            out += self._close(gid)
        return out

    @property
    def pending(self) -> list[Row]:
        """Rows taken but not decided yet (waiting for the rest of their group)."""
        return [r for g in self._groups.values() for r in g.rows]

    def _close(self, gid: str) -> list[Decision]:
        rows = self._groups.pop(gid).rows
        best = best_trajectory(rows, self.rule)
        out = []
        for r in rows:
            if r.whole_id == best:
                out.append(Decision(r, True))
            else:
                out.append(Decision(r, False, self.rule.admits(r.traj) or "not_best"))
        return out


def best_trajectory(rows: list[Row], rule: Rule) -> str:
    """The whole id of the group's best admitted trajectory ('' when none is admitted)."""
    candidates = [r.traj for r in rows if not rule.admits(r.traj)]
    if not candidates:
        return ""
    best = max(candidates, key=lambda t: (t.reward, -t.sample_index))
    return best.part_of or best.event_id
