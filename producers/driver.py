"""The experiment driver's schedule: which step's tasks go out when, and when the policy is evaluated.

Bounded asynchrony (the experiment's ``async_level`` S). A step's tasks go out while the engines serve a
policy at most S versions behind the one that step will train: step k (0-based, trained into version
k + 1) may be submitted once version k - S is served. So at most S + 1 steps are in flight, and S = 0 is
the on-policy loop: step k goes out when step k - 1's weights are served. The trainer bounds the same
thing where it trains (``max_staleness`` = S: one setting for both ends). Groups finish out of order, so
at S > 0 a straggler of step k can reach the trainer after step k + 1's groups, past the bound: the
trainer down-weights it (``stale_mode=downweight``) rather than drop it, which would leave a step short.

Evaluation is pinned to one policy version: the eval tasks of version v go out once v is served, and no
step that would train past v goes out before they are in (an eval is a barrier; it drains the pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    steps: int  # trainer steps in the run
    async_level: int = 0  # S
    eval_every: int = 0  # also evaluate every N trained steps (0: before and after only)
    evaluate: bool = True  # False: no evaluation at all

    def eval_versions(self) -> list[int]:
        """The policy versions evaluated: 0 (before training), every ``eval_every``, and the last."""
        if not self.evaluate:
            return []
        every = range(self.eval_every, self.steps, self.eval_every) if self.eval_every else []
        return sorted({0, *every, self.steps})

    def due_steps(self, submitted: int, served: int, evaluated: set[int]) -> range:
        """The steps whose tasks may go out now, given ``submitted`` steps out already, the served policy
        version and the versions already evaluated."""
        limit = min(self.steps, served + self.async_level + 1)
        for v in self.eval_versions():
            if v not in evaluated and v < self.steps:
                limit = min(limit, v)  # step v would train past version v: not before v is evaluated
        return range(submitted, max(submitted, limit))

    def due_eval(self, served: int, evaluated: set[int], evaluating: set[int]) -> int | None:
        """The version whose eval may go out now (served, not yet evaluated nor running), else None."""
        for v in self.eval_versions():
            if v == served and v not in evaluated and v not in evaluating:
                return v
        return None
