"""Hand-made trajectories whose numbers are easy to compute by hand."""

from __future__ import annotations

from schemas import Trace, Trajectory


def trace(calls: list[int], version: int = 0, side: bool = False, reason: str = "") -> Trace:
    """Per call: 3 prompt/interstitial tokens (mask 0) then 2 sampled ones (mask 1)."""
    ids, mask, lps = [], [], []
    for i in calls:
        ids += [10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4, 10 * i + 5]
        mask += [0, 0, 0, 1, 1]
        lps += [0.0, 0.0, 0.0, -0.25 - i, -0.5]
    return Trace(call_indices=calls, token_ids=ids, loss_mask=mask, logprobs=lps,
                 policy_versions=[version] * len(calls), break_reason=reason, side_call=side)


def traj(group: str, sample: int, reward: float, status: str = "ok", *, attempt: int = 0, harness: str = "codex",
         version: int = 0, task_set: str = "default", turns: int = 2, side_call: bool = False,
         compaction: bool = False, usable: bool | None = None) -> Trajectory:
    """A session of ``turns`` main calls (one trace, or two after a compaction), plus a side call."""
    main = list(range(turns))
    traces = ([trace(main[:1], version, reason="first_call"), trace(main[1:], version, reason="compaction")]
              if compaction else [trace(main, version, reason="first_call")])
    if side_call:
        traces.append(trace([turns], version, side=True, reason="side_call"))
    stats = {"calls": float(turns + side_call)}
    if compaction:
        stats["break.compaction"] = 1.0
    usable = status in ("ok", "timeout") if usable is None else usable
    metrics = {} if usable else {f"masked.status_{status}": 1.0}
    return Trajectory(
        event_id=f"{group}-s{sample}-a{attempt}", session_id=f"{group}-s{sample}-a{attempt}", group_id=group,
        task_id=group, sample_index=sample, attempt=attempt, status=status, reward=reward, usable=usable,
        metrics=metrics, harness=harness, task_set=task_set, traces=traces, stats=stats,
    )
