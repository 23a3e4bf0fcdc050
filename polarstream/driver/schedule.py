"""The experiment driver's schedule: which step's tasks go out when, and when the policy is evaluated.
Pure: no I/O here; steps.py applies it to what the run's topics say.

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

Curriculum. With ``retire`` on, a task whose last ``retire_after`` groups were all solved (or all
unsolved) is no longer drawn (``Curriculum``): it teaches nothing now. Step k's retired set is read from the
groups of steps before k - S, which are all in when step k may go out (the driver waits for them), so it
is the same set on every start of the run.

Resume. The driver keeps no state of its own: which tasks step k trains is a function of the seed and k
(``step_batches``), and a task's id names its run, step and place (``task_id``), so what went out is
read back from polar.tasks (``submitted``) and what came back from polar.groups and polar.policy. A
restarted driver reads them and goes on: it re-sends only what never reached the topic, and waits for
the rest, whose sessions run on regardless.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Iterable, Iterator, Sequence
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


def task_stream(tasks: Sequence[T], seed: int, order: str = "draws") -> Iterator[T]:
    """The run's tasks, one after another, the same on every start. ``draws``: draws with replacement from
    one stream seeded by ``seed`` (the demo's order since its first run). ``epochs``: every task once per
    epoch, in a shuffle seeded by the seed and the epoch."""
    if order not in ("draws", "epochs"):
        raise ValueError(f"order: {order!r} is neither 'draws' nor 'epochs'")
    if order == "draws":
        rng = random.Random(seed)
        while True:
            yield rng.choice(tasks)
    epoch = 0
    while True:
        shuffled = list(tasks)
        random.Random(f"{seed}:epoch:{epoch}").shuffle(shuffled)
        yield from shuffled
        epoch += 1


def step_batches(tasks: Sequence[T], seed: int, steps: int, per_step: int, order: str = "draws") -> list[list[T]]:
    """The tasks of every step: ``per_step`` at a time from ``task_stream`` (in epochs a step may straddle
    two, so every step is full)."""
    stream = task_stream(tasks, seed, order)
    return [list(itertools.islice(stream, per_step)) for _ in range(steps)]


def outcome(rewards: Sequence[float]) -> str:
    """A group's outcome for the curriculum: solved (every sample scored 1), unsolved (every one 0), mixed."""
    if rewards and all(r >= 1.0 for r in rewards):
        return "solved"
    if rewards and all(r <= 0.0 for r in rewards):
        return "unsolved"
    return "mixed"


def retired(history: dict[str, list[str]], retire: str, after: int) -> set[str]:
    """The tasks (by key) a step no longer draws: those whose last ``after`` groups (``history``: outcomes
    in the order the groups went out) were all solved (``retire`` solved or both) or all unsolved
    (unsolved or both). ``none``: none."""
    kinds = {"none": (), "solved": ("solved",), "unsolved": ("unsolved",), "both": ("solved", "unsolved")}[retire]
    return {key for key, seen in history.items()
            if len(seen) >= after and any(all(o == kind for o in seen[-after:]) for kind in kinds)}


class Curriculum:
    """Step k's tasks under a retirement filter: the next ``per_step`` of ``task_stream`` that are not
    retired as of step k. Steps are drawn in order, each with the retired set of its own time, so a
    restarted driver that replays the same sets (from the groups on Kafka) draws the same steps. When
    every task is retired the filter stands aside: a step is never left short."""

    def __init__(self, tasks: Sequence[T], seed: int, order: str, per_step: int, key):
        self._stream = task_stream(tasks, seed, order)
        self._keys = {key(t) for t in tasks}
        self.key, self.per_step = key, per_step
        self.batches: list[list[T]] = []
        self.retired: list[set[str]] = []  # per step: what it skipped (its replacements skip it too)

    def draw(self, gone: set[str]) -> list[T]:
        """The next step's tasks, skipping ``gone`` (the retired keys)."""
        if self._keys <= gone:
            gone = set()
        self.retired.append(gone)
        batch: list[T] = []
        while len(batch) < self.per_step:
            t = next(self._stream)
            if self.key(t) not in gone:
                batch.append(t)
        self.batches.append(batch)
        return batch


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
    """Replacement ``j`` of step ``step``, drawn from ``tasks`` (the train tasks less those the curriculum
    retired for that step): the same task on every start of the run."""
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
