"""What each step gave (``StepResult``, read off its groups and the PolicyVersion that trained them), and the
figures of the whole run: per train task, and over the training loop (steps per hour, the engine's idle
share, the machine's busy cores: bench/driver.py compares async levels on them)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from schemas import PolicyVersion, TaskRequest, TrainingGroup

from .schedule import outcome


@dataclass
class StepResult:
    step: int
    reward: float
    samples: int
    groups: int
    traces: int
    calls: int
    sampled_tokens: int
    wall_s: float
    policy_version: int
    trace_tokens: int = 0  # what the trainer runs through: every token of every training sequence
    entropy: float | None = None  # the trainer's step: mean entropy of the trained tokens, gradient norm,
    grad_norm: float | None = None  # and the learning rate it used (from the PolicyVersion it published)
    lr: float | None = None
    mismatch_k3: float | None = None  # rollout-vs-trainer divergence on the trained tokens: k3 KL per token,
    ratio_max: float | None = None  # the largest and 99th-percentile token ratio pi_trainer / pi_rollout,
    ratio_p99: float | None = None
    corrected_frac: float | None = None  # and the share of tokens the trainer's correction masked or capped
    group_ids: list[str] = field(default_factory=list)  # report.md links each to its viewer page
    # groups without signal (every sample scored the same): masked, they close the step but move nothing
    all_correct: int = 0  # every sample scored 1: too easy now
    all_wrong: int = 0  # every sample scored 0: too hard now
    replaced: int = 0  # zero_signal replace: groups without signal dropped (counted above) and replaced
    # the weight sync that put this step's weights into the engines (the trainer's train.jsonl, when the
    # trainer runs here): seconds in all, how (broadcast, storage, or mixed: some engines each way), and the
    # longest an engine held new requests for it (what rollouts lost)
    sync_s: float | None = None
    sync_mode: str | None = None
    engine_pause_s: float | None = None

    @property
    def merge_rate(self) -> float:
        return merge_rate(self.traces, self.calls)


def merge_rate(traces: int, calls: int) -> float:
    """Share of calls that needed no training sequence of their own (prefix-merged into an earlier one)."""
    return 1.0 - traces / calls if calls else 0.0


def step_result(step: int, groups: list[TrainingGroup], wall_s: float, version: int,
                trained: PolicyVersion | None = None, dropped: list[TrainingGroup] = ()) -> StepResult:
    """``trained``: the PolicyVersion the trainer published after training on ``groups``; ``dropped``: the
    step's groups without signal that the trainer dropped and the driver replaced."""
    flat = [*groups, *dropped]
    trajs = [t for g in groups for t in g.trajectories]
    m = trained.metrics if trained is not None else {}
    return StepResult(
        step=step,
        reward=sum(t.reward for t in trajs) / len(trajs) if trajs else 0.0,
        samples=len(trajs),
        groups=len(groups),
        traces=sum(len(t.traces) for t in trajs),
        calls=int(sum(t.stats.get("calls", 0) for t in trajs)),
        sampled_tokens=sum(sum(tr.loss_mask) for t in trajs for tr in t.traces),
        wall_s=wall_s,
        policy_version=version,
        trace_tokens=sum(len(tr.loss_mask) for t in trajs for tr in t.traces),
        group_ids=[g.group_id for g in groups],
        entropy=m.get("entropy"),
        grad_norm=m.get("grad_norm"),
        lr=m.get("lr"),
        mismatch_k3=m.get("mismatch_k3"),
        ratio_max=m.get("mismatch_ratio_max"),
        ratio_p99=m.get("mismatch_ratio_p99"),
        corrected_frac=m.get("corrected_frac"),
        all_correct=sum(outcome([t.reward for t in g.trajectories]) == "solved" for g in flat),
        all_wrong=sum(outcome([t.reward for t in g.trajectories]) == "unsolved" for g in flat),
        replaced=len(dropped),
    )


def sync_figures(record: dict) -> dict:
    """A trainer ``sync`` event (trainer/sync/syncer.py) as StepResult's sync fields."""
    how = [m for m in ("broadcast", "storage") if record.get(m)]
    pauses = [v for v in (record.get("engine_pause_s") or {}).values() if v is not None]
    mode = "mixed" if len(how) == 2 else how[0] if how else record.get("mode")
    if record.get("adapter"):  # a LoRA run's: only the adapter moved (in memory, or by /v1/load_lora_adapter)
        mode = f"{mode} adapter"
    return {"sync_s": record.get("sync_s"), "sync_mode": mode, "engine_pause_s": max(pauses) if pauses else None}


def fill_syncs(results: list[StepResult], policies: dict[int, PolicyVersion]) -> None:
    """Give each step without its sync yet the sync of the version it trained (step k: version k + 1), from
    polar.policy: the trainer publishes each version again with its sync once the engines serve it (the later
    record of a version is the Watcher's), so this works wherever the trainer runs."""
    for r in results:
        got = policies.get(r.step + 1)
        if r.sync_s is None and got is not None and got.sync:
            figures = sync_figures(got.sync)
            r.sync_s, r.sync_mode, r.engine_pause_s = figures["sync_s"], figures["sync_mode"], figures["engine_pause_s"]


def per_task(trained: dict[str, TaskRequest], groups: dict[str, TrainingGroup]) -> dict[str, dict]:
    """Per train task (its template's id: an arith problem's is its question), the groups trained on it and
    their mean reward, in the order first trained; the curriculum's view of which tasks are solved or still
    hard. ``trained``: group id -> the template it was sent from."""
    stats: dict[str, list[float]] = {}
    for gid, task in trained.items():
        group = groups.get(gid)
        if group is not None and group.trajectories:
            stats.setdefault(task.task_id, []).append(sum(t.reward for t in group.trajectories) / len(group.trajectories))
    return {name: {"groups": len(r), "mean_reward": round(sum(r) / len(r), 3)} for name, r in stats.items()}


def session_stages(start: dict | None, end: dict | None) -> dict:
    """Mean seconds per session of each stage over the loop, by sandbox ("podman.open": 0.12), from the
    node's totals at its start and end (serving.node_stage_totals); {} where unmeasured."""
    if start is None or end is None:
        return {}
    means = {}
    for key, (seconds, n) in sorted(end.items()):
        s0, n0 = start.get(key, [0.0, 0.0])
        if n > n0:
            means[key] = round((seconds - s0) / (n - n0), 3)
    return {"session_stage_s": means}


def loop_figures(loop: dict, steps: int) -> dict:
    """steps/hour over the training loop, the engine's idle fraction in it, and how many of the machine's
    cores everything on it kept busy meanwhile (what overlap can still use: bench/driver.py) (None where
    unmeasured)."""
    span = loop["end"] - loop["start"] if {"start", "end"} <= loop.keys() else None
    busy = (loop["busy_end"] - loop["busy_start"]) if None not in (loop.get("busy_start"), loop.get("busy_end")) else None
    cpu = (loop.get("cpu_start"), loop.get("cpu_end"))
    cores = cpu[1][2] if cpu[1] else None
    busy_cores = ((cpu[1][0] - cpu[0][0]) / (cpu[1][1] - cpu[0][1]) * cores
                  if None not in cpu and cpu[1][1] > cpu[0][1] else None)
    return {**session_stages(loop.get("stages_start"), loop.get("stages_end")),
            "rl_loop_s": round(span, 1) if span else None,
            "steps_per_hour": round(steps / span * 3600, 1) if span else None,
            "engine_idle_fraction": round(max(0.0, 1 - busy / span), 3) if span and busy is not None else None,
            "machine_busy_cores": round(busy_cores, 3) if busy_cores is not None else None, "cores": cores}
