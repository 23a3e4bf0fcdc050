"""Per-task progress folded from SessionEvents (pure; the server feeds it from Kafka).

Each sample keeps only its latest attempt: an event of an older attempt (a node died and the sample was
re-run) is ignored, one of a newer attempt replaces the sample's state. A sample is *usable* when it
finished ``ok`` with a reward and at least one recorded call, Polar's "completed with trainable tokens";
early stop counts those.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from schemas import SessionEvent, TaskRequest

STAGES = ("assigned", "started", "harness_exited", "evaluated", "finished")


@dataclass
class SampleState:
    attempt: int = 0
    session_id: str = ""
    stage: str = "assigned"
    status: str | None = None
    reward: float | None = None
    num_calls: int | None = None
    harness: str = ""
    detail: str = ""

    @property
    def usable(self) -> bool:
        return self.stage == "finished" and self.status == "ok" and self.reward is not None and (self.num_calls or 0) > 0


@dataclass
class TaskState:
    task: TaskRequest
    submitted_at: float = field(default_factory=time.time)
    cancelled: str = ""
    samples: dict[int, SampleState] = field(default_factory=dict)
    finished_at: float | None = None

    @property
    def finished(self) -> int:
        return sum(s.stage == "finished" for s in self.samples.values())

    @property
    def usable(self) -> int:
        return sum(s.usable for s in self.samples.values())

    @property
    def done(self) -> bool:
        return self.finished >= self.task.num_samples

    def should_stop_early(self) -> bool:
        """Enough usable samples are in and some are still running: cancel the stragglers."""
        return bool(self.task.early_stop) and not self.cancelled and not self.done and self.usable >= self.task.early_stop

    def summary(self, samples: bool = False) -> dict[str, Any]:
        """What ``polarstream status`` shows for the task."""
        stages = Counter(s.stage for s in self.samples.values())
        statuses = Counter(s.status for s in self.samples.values() if s.stage == "finished")
        rewards = [s.reward for s in self.samples.values() if s.stage == "finished" and s.reward is not None]
        out: dict[str, Any] = {
            "task_id": self.task.task_id, "group_id": self.task.group_id, "num_samples": self.task.num_samples,
            "state": "cancelled" if self.cancelled and not self.done else ("done" if self.done else "running"),
            "cancelled": self.cancelled, "stages": {k: stages.get(k, 0) for k in STAGES},
            "statuses": dict(statuses), "finished": self.finished, "usable": self.usable,
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "retried": sum(s.attempt > 0 for s in self.samples.values()),
            "submitted_at": self.submitted_at, "finished_at": self.finished_at,
        }
        if samples:
            out["samples"] = {i: vars(s) for i, s in sorted(self.samples.items())}
        return out


def new_task_state(task: TaskRequest, session_ids: list[str]) -> TaskState:
    """A task's state right after fan-out: every sample assigned, attempt 0."""
    return TaskState(task, samples={i: SampleState(session_id=sid, harness=task.harness.name) for i, sid in enumerate(session_ids)})


def apply_event(state: TaskState, ev: SessionEvent, now: float | None = None) -> bool:
    """Fold one event into the task's state; False when it was stale (an older attempt) or unknown."""
    sample = state.samples.get(ev.sample_index)
    if sample is None:
        return False
    if ev.attempt < sample.attempt:
        return False
    if ev.attempt > sample.attempt:
        state.samples[ev.sample_index] = sample = SampleState(attempt=ev.attempt, session_id=ev.session_id, harness=ev.harness)
    if sample.stage == "finished":
        return False  # a duplicate or a marker after the outcome: the outcome stands
    if ev.kind == "harness_exited" and ev.session_id != sample.session_id:
        return False  # a marker about another attempt's session
    sample.session_id = ev.session_id
    sample.stage = ev.kind if STAGES.index(ev.kind) > STAGES.index(sample.stage) else sample.stage
    sample.harness = ev.harness or sample.harness
    if ev.status is not None:
        sample.status = ev.status
    if ev.reward is not None:
        sample.reward = ev.reward
    if ev.kind == "finished":
        sample.stage, sample.num_calls, sample.detail = "finished", ev.num_calls, ev.detail
        if state.done and state.finished_at is None:
            state.finished_at = now if now is not None else time.time()
    return True
