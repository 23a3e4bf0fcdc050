"""Held-out evaluation: the eval of policy version v goes out once v is served (the schedule says when),
and is in once every one of its groups is; its pass@1, pass@n and avg@n are then read back from
polar.trajectories with the ``polarstream eval`` reader, the same report a user gets."""

from __future__ import annotations

from collections.abc import Mapping

from infra.settings import Settings

from .processes import ProcessFailed

# The task set of every eval task: the trainer consumes and skips its groups (skip_task_sets)
HELDOUT_SET = "demo-heldout"


def heldout_metrics(settings: Settings, samples: int) -> dict[int, dict[str, float]]:
    """The held-out task set's pass@1, pass@n (unbiased, n = ``samples``) and avg@n (mean reward) per policy
    version, from polar.trajectories through the ``polarstream eval`` reader, with failed and infra-error
    samples counted as not passing."""
    from polarstream.tools.eval_run import run_eval

    report = run_eval(settings, ks=(1, samples), failures_fail=True)  # a broken sandbox scores 0, not nothing
    return {c["policy_version"]: {"pass@1": c["pass@1"], f"pass@{samples}": c[f"pass@{samples}"],
                                  f"avg@{samples}": c["mean_reward"]}
            for c in report["cells"] if c["task_set"] == HELDOUT_SET}


class Evals:
    """The run's evals from submission to score: which are out (``out``), which scored (``evaluated``, by
    version), and their figures by label (``held``: pass@1; ``metrics``: pass@1, pass@n, avg@n)."""

    def __init__(self, settings: Settings, steps: int, samples: int, timeout_s: float, tracker):
        self.settings, self.steps, self.samples, self.timeout_s, self.tracker = settings, steps, samples, timeout_s, tracker
        self.out: dict[int, tuple[set[str], float]] = {}  # policy version -> (its eval groups, when they went out)
        self.evaluated: dict[int, float] = {}  # policy version -> held-out pass@1
        self.held: dict[str, float] = {}  # "before", "step k", "after" -> pass@1
        self.metrics: dict[str, dict[str, float]] = {}  # ... -> pass@1, pass@n and avg@n

    def label(self, v: int) -> str:
        return "before" if v == 0 else "after" if v == self.steps else f"step {v}"

    def collect(self, groups: Mapping[str, object], now: float, since: float, logs: object) -> None:
        """Score each eval whose groups are all in; ProcessFailed for one out longer than the step timeout
        (counted from ``since`` where it went out before this driver started)."""
        for v, (wanted, started) in list(self.out.items()):
            if wanted <= groups.keys():  # its eval is in: pass@1 at that version (polarstream eval)
                scores = heldout_metrics(self.settings, self.samples).get(v) or {"pass@1": 0.0}
                self.evaluated[v] = scores["pass@1"]
                self.held[self.label(v)], self.metrics[self.label(v)] = self.evaluated[v], scores
                self.tracker.eval(v, scores)
                del self.out[v]
            elif now - max(started, since) > self.timeout_s:
                raise ProcessFailed(f"held-out eval of version {v} did not finish within {self.timeout_s:.0f}s "
                                    f"(groups {len(wanted & groups.keys())}/{len(wanted)}); logs in {logs}")
