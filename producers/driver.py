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

Zero-signal groups (every sample scored the same: no gradient). ``mask``: they fill their step and move no
weight. ``replace`` (DAPO's dynamic sampling): the trainer drops them (the task says so: ``zero_signal``) and
the driver sends another task in each one's place, so a step trains on signal. A replacement may itself come
back flat and be replaced, but only ``replace_cap`` times a step: later replacements are masked, so every
step closes (``zero_signal_wish``). Replacement j of step k is a draw seeded by the seed, k and j.

Resume. The driver keeps no state of its own: which tasks step k trains is a function of the seed and k
(``step_batches``), and a task's id names its run, step and place (``task_id``), so what went out is
read back from polar.tasks (``submitted``) and what came back from polar.groups and polar.policy. A
restarted driver reads them and goes on: it re-sends only what never reached the topic, and waits for
the rest, whose sessions run on regardless.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


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


def step_batches(tasks: Sequence[T], seed: int, steps: int, per_step: int, order: str = "draws") -> list[list[T]]:
    """The tasks of every step, the same on every start of the run. ``draws``: ``per_step`` draws a step,
    with replacement, from one stream seeded by ``seed`` (the demo's order since its first run). ``epochs``:
    every task once per epoch, in a shuffle seeded by the seed and the epoch; steps run on through the
    epochs (a step may straddle two), so every step is full."""
    if order == "draws":
        rng = random.Random(seed)
        return [[rng.choice(tasks) for _ in range(per_step)] for _ in range(steps)]
    if order != "epochs":
        raise ValueError(f"order: {order!r} is neither 'draws' nor 'epochs'")
    stream: list[T] = []
    epoch = 0
    while len(stream) < steps * per_step:
        shuffled = list(tasks)
        random.Random(f"{seed}:epoch:{epoch}").shuffle(shuffled)
        stream += shuffled
        epoch += 1
    return [stream[k * per_step:(k + 1) * per_step] for k in range(steps)]


def epoch_steps(tasks: int, per_step: int, epochs: int) -> int:
    """Steps that train every one of ``tasks`` tasks ``epochs`` times (the last may start the next epoch)."""
    return -(-tasks * epochs // per_step)


def zero_signal_wish(index: int, per_step: int, replace_cap: int) -> str:
    """What the trainer does with the group of task ``index`` of a step (its own ``per_step`` tasks first,
    then replacement j at ``per_step + j``) when it has no signal, under ``zero_signal: replace``: drop it
    (the driver replaces it), or, past the cap, mask it."""
    return "drop" if index < per_step + replace_cap else "mask"


def replacements_due(flat: Iterable[int], per_step: int, replace_cap: int) -> int:
    """How many replacements a step needs: one per arrived group without signal that was dropped
    (``flat``: their task indices in the step)."""
    return sum(zero_signal_wish(i, per_step, replace_cap) == "drop" for i in flat)


def replacement(tasks: Sequence[T], seed: int, step: int, j: int) -> T:
    """Replacement ``j`` of step ``step``: the same task on every start of the run."""
    return random.Random(f"{seed}:replace:{step}:{j}").choice(list(tasks))


def task_id(run_id: str, tag: str, index: int) -> str:
    """The id (and group id) of task ``index`` of a step (tag ``s007``) or an eval (tag ``eval-v3``)."""
    return f"{run_id}-{tag}-t{index}"


def step_tag(step: int) -> str:
    return f"s{step:03d}"


def eval_tag(version: int) -> str:
    return f"eval-v{version}"


def submitted(run_id: str, group_ids: Iterable[str]) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
    """What went out, from the group ids on polar.tasks: {step: task indices}, {eval version: task indices}.
    Ids of other runs are ignored."""
    pattern = re.compile(rf"{re.escape(run_id)}-(?:s(\d+)|eval-v(\d+))-t(\d+)")
    steps: dict[int, set[int]] = {}
    evals: dict[int, set[int]] = {}
    for gid in group_ids:
        m = pattern.fullmatch(gid)
        if m is None:
            continue
        step, version, index = m.groups()
        into = steps if step is not None else evals
        into.setdefault(int(step if step is not None else version), set()).add(int(index))
    return steps, evals
