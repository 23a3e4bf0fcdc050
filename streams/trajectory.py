"""One Trajectory from a finished session: its traces, reward, status and whether it may train.

The record is a pure function of its inputs: the event id hashes the session, attempt, builder
settings, the sorted call event ids and the finished event id, and ``created_at`` is the latest input
event's time. A trajectory rebuilt after a crash is therefore byte-identical to the first one.
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas import SessionEvent, Trajectory, derived_event_id

from .assembly import CallTokens
from .builders import assemble
from .config import StreamsConfig

# Statuses that never train: the sample says nothing about the policy (infra) or was abandoned.
MASKED_STATUSES = {"failed", "infra_error", "cancelled"}


def trajectory_id(finished: SessionEvent, calls: Sequence[CallTokens], config: StreamsConfig) -> str:
    """Deterministic event id of the trajectory built from these inputs."""
    return derived_event_id(
        "trajectory", finished.session_id, finished.attempt, config.trajectory_fingerprint(),
        *sorted(c.event_id for c in calls), finished.event_id,
    )


def usable_and_reward(finished: SessionEvent, config: StreamsConfig) -> tuple[bool, float, str]:
    """(usable, reward, why-not) for a finished session's status and reward."""
    status = finished.status or "failed"
    if status in MASKED_STATUSES:
        return False, 0.0, f"status_{status}"
    if status == "timeout":
        return True, config.timeout_reward, ""  # an agent-budget timeout is a real (bad) outcome
    if finished.reward is None:
        return False, 0.0, "no_reward"
    return True, float(finished.reward), ""


def build_trajectory(
    finished: SessionEvent, calls: Sequence[CallTokens], config: StreamsConfig, missing_calls: int = 0
) -> Trajectory:
    """The session's Trajectory; ``missing_calls`` > 0 (gave up waiting) masks it out of its group."""
    result = assemble(calls, config.builder, config.side_calls, session=finished.session_id)
    usable, reward, why = usable_and_reward(finished, config)
    trainable = sum(sum(t.loss_mask) for t in result.traces)
    if usable and missing_calls:
        usable, why = False, "missing_calls"
    if usable and trainable == 0:
        usable, why = False, "no_trainable_tokens"
    stats: dict[str, float] = {
        "calls": float(len(calls)),
        "traces": float(len(result.traces)),
        "merged": float(result.merged),
        "breaks": float(sum(result.breaks.values())),
        "dropped_calls": float(len(result.dropped)),
        "side_calls_left_out": float(result.side_calls_left_out),
        "missing_calls": float(missing_calls),
        "tokens": float(sum(len(t.token_ids) for t in result.traces)),
        "trainable_tokens": float(trainable),
    }
    stats.update({f"break.{r}": float(n) for r, n in sorted(result.breaks.items())})
    metrics = dict(finished.metrics)
    if finished.reward is not None and float(finished.reward) != reward:
        metrics["raw_reward"] = float(finished.reward)
    if why:
        metrics[f"masked.{why}"] = 1.0
    group_id = finished.group_id or finished.task_id or finished.session_id
    return Trajectory(
        event_id=trajectory_id(finished, calls, config),
        created_at=max([finished.created_at, *(c.created_at for c in calls)]),
        session_id=finished.session_id,
        group_id=group_id,
        task_id=finished.task_id,
        sample_index=finished.sample_index,
        attempt=finished.attempt,
        num_samples=finished.num_samples,
        min_valid=finished.min_valid,
        status=finished.status or "failed",
        reward=reward,
        usable=usable,
        metrics=metrics,
        harness=finished.harness,
        task_set=finished.task_set,
        zero_signal=finished.zero_signal,
        builder=config.builder,
        traces=result.traces,
        stats=stats,
    )
