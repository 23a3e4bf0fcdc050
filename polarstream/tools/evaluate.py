"""Evaluation from recorded trajectories: pass@k, rewards, tokens, turns, timeouts, merge breaks.

Pure functions over ``Sample``s (the few fields of a Trajectory that evaluation needs, so a follower
that runs for days keeps kilobytes per session, not its token ids). Results are cut per
harness × policy version × task set ("cells").

Which samples count:
- one per (group, sample_index): a retried session's latest attempt replaces the earlier ones;
- statuses ``ok`` and ``timeout`` are outcomes of the policy (a timeout never passes); ``failed``,
  ``infra_error`` and ``cancelled`` say nothing about it, exactly as the stream processors mask them
  from training, and are only counted (``excluded``). With ``failures_fail`` (an experiment's evals),
  ``failed`` and ``infra_error`` count as samples that did not pass, so a broken sandbox cannot raise a
  score by dropping what it could not finish; ``cancelled`` (stopped on purpose) stays out;
- a sample passes when its status is ok and its reward is at least ``threshold``.

pass@k is the unbiased estimator of Chen et al. (2021), per task, averaged over the cell's tasks that
have at least k samples: with n samples of which c pass, 1 - C(n-c, k) / C(n, k).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from schemas import Parts, Trajectory
from streams.trajectory import MASKED_STATUSES

OUTCOME_STATUSES = ("ok", "timeout")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) passes:
    1 - C(n-c, k) / C(n, k), computed with exact integers (one rounding, at the division)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class Sample:
    """What evaluation keeps of one Trajectory."""

    event_id: str
    group_id: str
    sample_index: int
    attempt: int
    task_id: str
    harness: str
    task_set: str
    policy_version: int  # of the session's first call (-1: no call made it into a trace)
    status: str
    reward: float
    usable: bool
    tokens: int  # every token of its traces: what training would process
    sampled_tokens: int  # tokens the policy sampled (loss mask 1)
    turns: int  # main-conversation calls (side calls not counted)
    breaks: tuple[tuple[str, int], ...] = ()  # merge-break reason -> count
    masked: tuple[str, ...] = ()  # why it is masked out of training, if it is

    @classmethod
    def of(cls, t: Trajectory) -> "Sample":
        firsts = [(tr.call_indices[0], tr.policy_versions[0]) for tr in t.traces if tr.call_indices and tr.policy_versions]
        side = sum(len(tr.call_indices) for tr in t.traces if tr.side_call)
        calls = int(t.stats.get("calls", sum(len(tr.call_indices) for tr in t.traces)))
        return cls(
            event_id=t.event_id, group_id=t.group_id, sample_index=t.sample_index, attempt=t.attempt,
            task_id=t.task_id or t.group_id, harness=t.harness or "unknown", task_set=t.task_set,
            policy_version=min(firsts)[1] if firsts else -1, status=t.status, reward=t.reward, usable=t.usable,
            tokens=sum(len(tr.token_ids) for tr in t.traces),
            sampled_tokens=sum(sum(tr.loss_mask) for tr in t.traces),
            turns=max(0, calls - side - int(t.stats.get("side_calls_left_out", 0))),
            breaks=tuple(sorted((k.removeprefix("break."), int(v)) for k, v in t.stats.items() if k.startswith("break.") and v)),
            masked=tuple(sorted(k.removeprefix("masked.") for k in t.metrics if k.startswith("masked."))),
        )


@dataclass
class Latest:
    """One sample per (group, sample_index), the latest attempt; repeats (same event id) are dropped."""

    samples: dict[tuple[str, int], Sample] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)
    duplicates: int = 0
    superseded: int = 0
    parts: Parts = field(default_factory=Parts)

    def add(self, t: Trajectory) -> bool:
        """Take a trajectory (or a part of one sent in parts: counted once all are in); True when it
        changed the samples."""
        return self.take(t) is not None

    def take(self, t: Trajectory) -> Trajectory | None:
        """``add``, returning the whole trajectory when it changed the samples, else None."""
        if t.parts > 1:
            if t.part_of in self.seen:
                self.duplicates += 1
                return None
            whole = self.parts.add(t)
            if whole is None:
                return None
            t = whole
        if t.event_id in self.seen:
            self.duplicates += 1
            return None
        self.seen.add(t.event_id)
        key = (t.group_id, t.sample_index)
        held = self.samples.get(key)
        if held is not None and held.attempt >= t.attempt:  # same attempt twice: the first stays, as live
            self.superseded += 1
            return None
        self.superseded += held is not None
        self.samples[key] = Sample.of(t)
        return t


def _mean(xs: list[float]) -> float | None:
    return math.fsum(xs) / len(xs) if xs else None


FAILURE_STATUSES = ("failed", "infra_error")


def evaluate_cell(samples: list[Sample], ks: Iterable[int], threshold: float, failures_fail: bool = False) -> dict:
    """Metrics of one cell's samples (see the module doc for what counts)."""
    counted = OUTCOME_STATUSES + (FAILURE_STATUSES if failures_fail else ())
    outcomes = [s for s in samples if s.status in counted]
    per_task: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # task -> [n, c]
    for s in outcomes:
        nc = per_task[s.task_id]
        nc[0] += 1
        nc[1] += s.status == "ok" and s.reward >= threshold
    breaks: Counter = Counter()
    for s in samples:
        breaks.update(dict(s.breaks))
    pass_k = {}
    for k in sorted(set(ks)):
        eligible = [pass_at_k(n, c, k) for n, c in per_task.values() if n >= k]
        pass_k[f"pass@{k}"] = _mean(eligible)
        pass_k[f"tasks@{k}"] = len(eligible)
    timeouts = sum(s.status == "timeout" for s in outcomes)
    return {
        "samples": len(outcomes),
        "tasks": len(per_task),
        "passed": sum(c for _, c in per_task.values()),
        **pass_k,
        "mean_reward": _mean([s.reward for s in outcomes]),
        "timeouts": timeouts,
        "timeout_rate": timeouts / len(outcomes) if outcomes else None,
        "mean_turns": _mean([s.turns for s in outcomes]),
        "mean_tokens": _mean([s.tokens for s in outcomes]),
        "mean_sampled_tokens": _mean([s.sampled_tokens for s in outcomes]),
        "tokens": sum(s.tokens for s in outcomes),
        "sampled_tokens": sum(s.sampled_tokens for s in outcomes),
        "merge_breaks": dict(sorted(breaks.items())),
        "statuses": dict(sorted(Counter(s.status for s in samples).items())),
        "excluded": sum(s.status in MASKED_STATUSES and s.status not in counted for s in samples),
        "masked_from_training": dict(sorted(Counter(m for s in samples for m in s.masked).items())),
        "per_task": {t: {"n": n, "c": c} for t, (n, c) in sorted(per_task.items())},
    }


def evaluate(samples: Iterable[Sample], ks: Iterable[int] = (1,), threshold: float = 1.0,
             failures_fail: bool = False) -> list[dict]:
    """One result per harness × policy version × task set, sorted by that key."""
    ks = sorted({1, *ks})
    if ks[0] < 1:
        raise ValueError(f"k: every k must be at least 1, got {ks[0]}")
    cells: dict[tuple[str, int, str], list[Sample]] = defaultdict(list)
    for s in samples:
        cells[(s.harness, s.policy_version, s.task_set)].append(s)
    return [
        {"harness": h, "policy_version": v, "task_set": ts, **evaluate_cell(cells[(h, v, ts)], ks, threshold, failures_fail)}
        for h, v, ts in sorted(cells)
    ]
