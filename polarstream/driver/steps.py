"""The run's steps from submission to result: the state machine the loop ticks.

Each tick reads the run's topics (watcher.py), keeps the components alive, scores the evals that are in
(evaluation.py), closes the steps whose groups are in and trained, sends a replacement for each group the
trainer dropped, and sends what the schedule (schedule.py) allows at the version the engine serves
(serving.py). It holds nothing a restart would lose: ``resume`` reads back what an earlier driver of the
run sent, which is waited for, not sent again.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from functools import partial

from infra.process import machine_cpu
from infra.settings import Settings
from schemas import HarnessSpec, TaskRequest

from .config import RunConfig
from .evaluation import HELDOUT_SET, Evals
from .processes import Processes, ProcessFailed
from .results import StepResult, fill_syncs, loop_figures, per_task, step_result
from .schedule import (Curriculum, Schedule, eval_tag, outcome, replacement, replacements_due, retired, step_batches,
                       step_tag, submitted, task_id, zero_signal_wish)
from .serving import Served, engine_busy_s, node_stage_totals, stamped
from .submit import send, task_payload
from .watcher import Watcher, consumer_lag


SYNC_WAIT_S = 5.0  # how long the report waits for the last step's sync (none comes where sync_every is 0)


def _key(task: TaskRequest) -> str:
    """A template's name in the curriculum and the per-task figures."""
    return task.task_id


class Steps:
    """Which tasks go out when (the schedule, the curriculum, a replacement for each dropped group), what came
    back (the Watcher's topics), and where a restarted driver stands."""

    def __init__(self, cfg: RunConfig, run_id: str, settings: Settings, watcher: Watcher, procs: Processes, tracker,
                 urls: dict[str, str], train: list[TaskRequest], heldout: list[TaskRequest], harness: HarnessSpec):
        self.cfg, self.run_id, self.settings, self.watcher, self.procs, self.tracker = cfg, run_id, settings, watcher, procs, tracker
        self.urls, self.train, self.heldout, self.harness = urls, train, heldout, harness
        self.curriculum = Curriculum(train, cfg.seed, cfg.order, cfg.tasks_per_step, _key) if cfg.retire != "none" else None
        self.batches = (self.curriculum.batches if self.curriculum
                        else step_batches(train, cfg.seed, cfg.steps, cfg.tasks_per_step, cfg.order))
        self.per_step, self.replacing = cfg.tasks_per_step, cfg.zero_signal == "replace"
        self.schedule = Schedule(steps=cfg.steps, async_level=cfg.async_level, eval_every=cfg.eval_every,
                                 evaluate=bool(heldout) and cfg.heldout_samples > 0)
        # a LoRA run: what serves a version is the adapter the gateway stamps, not the engine's weights
        self.served = (Served(urls["gateway"], partial(stamped, admin_token=settings.admin_token, run=settings.topic_prefix))
                       if cfg.lora and urls.get("gateway") else Served(urls["engine"]))
        self.evals = Evals(settings, cfg.steps, cfg.heldout_samples, cfg.step_timeout_s, tracker)
        self.results: list[StepResult] = []
        self.steps_out: dict[int, tuple[set[str], float]] = {}  # step -> (its groups, when they went out)
        self.lag: dict[str, int] = {}
        # The training loop's span (first step out -> last step trained) and the engine's busy seconds in it:
        # steps per hour and the engine's idle fraction there (bench/driver.py compares async levels on them).
        self.loop: dict[str, float | None] = {}
        self.t_resume = time.monotonic()

    def item(self, k: int, i: int) -> TaskRequest:
        """Task ``i`` of step ``k``: its own ``per_step`` first, then its replacements (schedule.py)."""
        cfg = self.cfg
        while len(self.batches) <= k:  # the curriculum draws steps in order, each with its own retired set
            self.curriculum.draw(retired(self.history(len(self.batches) - cfg.async_level), cfg.retire, cfg.retire_after))
        if i < self.per_step:
            return self.batches[k][i]
        gone = self.curriculum.retired[k] if self.curriculum else set()
        return replacement([t for t in self.train if _key(t) not in gone], cfg.seed, k, i - self.per_step)

    def history(self, steps: int) -> dict[str, list[str]]:
        """Each task's group outcomes over steps before ``steps``, in the order they went out (all in: a
        step goes out only once the steps before k - S are done)."""
        seen: dict[str, list[str]] = {}
        for k in range(max(0, steps)):
            for i in itertools.count():
                group = self.watcher.groups.get(task_id(self.run_id, step_tag(k), i))
                if group is None and i >= self.per_step:
                    break
                if group is not None:
                    seen.setdefault(_key(self.item(k, i)), []).append(outcome([t.reward for t in group.trajectories]))
        return seen

    def step_task(self, k: int, i: int) -> dict:
        cfg = self.cfg
        wish = zero_signal_wish(i, self.per_step, cfg.replace_cap) if self.replacing else "mask"
        return task_payload(self.item(k, i), task_id(self.run_id, step_tag(k), i), cfg.samples, cfg.task_set, self.harness,
                            cfg.min_completion, cfg.early_stop_at, wish)

    def eval_tasks(self, v: int) -> list[dict]:  # every sample runs (no straggler early stop): pass@n needs n
        return [task_payload(t, task_id(self.run_id, eval_tag(v), i), self.cfg.heldout_samples, HELDOUT_SET, self.harness,
                             self.cfg.min_completion) for i, t in enumerate(self.heldout)]

    def send(self, tasks: list[dict], one_by_one: bool = False) -> set[str]:
        return send(self.urls["rollout"], tasks, one_by_one)

    @staticmethod
    def index(gid: str) -> int:
        return int(gid.rsplit("-t", 1)[1])

    def flat(self, gid: str) -> bool:
        """The group is in and has no signal."""
        g = self.watcher.groups.get(gid)
        return g is not None and g.no_signal

    def dropped(self, gid: str) -> bool:
        """The trainer drops this group: no signal, and its task asked for a drop (zero_signal replace)."""
        return (self.replacing and self.flat(gid)
                and zero_signal_wish(self.index(gid), self.per_step, self.cfg.replace_cap) == "drop")

    @property
    def done(self) -> bool:
        return len(self.results) >= self.cfg.steps and set(self.evals.evaluated) >= set(self.schedule.eval_versions())

    def resume(self) -> tuple[int, int]:
        """Where the run stands, from the topics: what an earlier driver of this run sent is waited for, not
        sent again (its sessions run on), and only what never reached polar.tasks is sent now. Returns how
        many steps and evals had been sent."""
        watcher, run_id = self.watcher, self.run_id
        watcher.catch_up()
        sent_steps, sent_evals = submitted(run_id, watcher.tasks)
        self.t_resume = time.monotonic()

        def sent_at(ids: set[str]) -> float:
            """When the earliest of ``ids`` reached polar.tasks, on this process's monotonic clock."""
            first = min((watcher.tasks[g] for g in ids if g in watcher.tasks), default=None)
            return self.t_resume if first is None else self.t_resume - max(0.0, time.time() - first / 1000)

        for k, have in sorted(sent_steps.items()):  # replacements still due are sent by tick
            ids = self.send([self.step_task(k, i) for i in sorted(set(range(self.per_step)) - have)], one_by_one=True)
            ids |= {task_id(run_id, step_tag(k), i) for i in have}
            self.steps_out[k] = (ids, sent_at(ids))
        for v, have in sorted(sent_evals.items()):
            ids = self.send([t for i, t in enumerate(self.eval_tasks(v)) if i not in have], one_by_one=True)
            ids |= {task_id(run_id, eval_tag(v), i) for i in range(len(self.heldout))}
            self.evals.out[v] = (ids, sent_at(ids))
        return len(sent_steps), len(sent_evals)

    def tick(self, on_step: Callable[[int, dict[str, str]], None] | None, metrics: dict[str, str], console) -> str:
        """One round: read the topics, keep the components alive, collect finished evals and steps, send
        replacements and what the schedule allows now; returns the status line."""
        cfg, watcher, results, steps_out, evals = self.cfg, self.watcher, self.results, self.steps_out, self.evals
        watcher.poll()
        trained = watcher.trained
        # after its last step the trainer is done (it stops at --max-steps); the rest must live. A
        # trainer that dies mid-run is started again: it resumes from its newest checkpoint.
        for name in self.procs.check_all(finished_ok=frozenset({"trainer"}) if trained >= cfg.steps else frozenset(),
                                         restart=frozenset({"trainer"})):
            console.print(f"{name} exited; started it again (it resumes from its newest checkpoint)")
            self.served.forget()  # it hands the engines its checkpoint's weights, which may be older
        # the version the engine serves now: a step goes out on-policy only once its weights are loaded
        served = self.served.version(trained)
        now = time.monotonic()
        evals.collect(watcher.groups, now, self.t_resume, self.procs.log_dir)
        for k in range(len(results), len(steps_out)) if self.replacing else ():
            wanted, started = steps_out[k]  # one replacement per group the trainer dropped
            due = replacements_due([self.index(g) for g in wanted if self.flat(g)], self.per_step, cfg.replace_cap)
            new = [self.step_task(k, self.per_step + j) for j in range(due)
                   if task_id(self.run_id, step_tag(k), self.per_step + j) not in wanted]
            if new:
                steps_out[k] = (wanted | self.send(new, one_by_one=True), started)
        while len(results) < len(steps_out):  # steps in order: groups in and trained into the next version
            k = len(results)
            wanted, started = steps_out[k]
            if not (wanted <= watcher.groups.keys() and trained >= k + 1):
                limit = cfg.step_timeout_s * (cfg.async_level + 1)
                if now - max(started, self.t_resume) > limit:
                    raise ProcessFailed(f"step {k + 1} did not finish within {limit:.0f}s "
                                        f"(groups {len(wanted & watcher.groups.keys())}/{len(wanted)}, policy {trained}); "
                                        f"logs in {self.procs.log_dir}")
                break
            results.append(step_result(k, [watcher.groups[g] for g in sorted(wanted) if not self.dropped(g)], now - started,
                                       watcher.policy.version, watcher.policies.get(k + 1),
                                       [watcher.groups[g] for g in sorted(wanted) if self.dropped(g)]))
            r = results[-1]
            self.tracker.step(k + 1, r.reward, r.groups, r.all_correct, r.all_wrong, r.replaced,
                              {"mismatch_k3": r.mismatch_k3, "mismatch_ratio_max": r.ratio_max,
                               "mismatch_ratio_p99": r.ratio_p99, "corrected_frac": r.corrected_frac})
            if len(results) == cfg.steps:
                self.loop.update(end=now, busy_end=engine_busy_s(self.urls["engine"]), cpu_end=machine_cpu(),
                                 stages_end=node_stage_totals(self.urls.get("gateway")))
            if on_step is not None:
                on_step(k, metrics)
            self.lag = consumer_lag(self.settings)
        fill_syncs(results, watcher.policies)
        if (v := self.schedule.due_eval(served, set(evals.evaluated), set(evals.out))) is not None:
            evals.out[v] = (self.send(self.eval_tasks(v)), now)
        for k in self.schedule.due_steps(len(steps_out), served, set(evals.evaluated)):
            if self.curriculum and len(results) < k - cfg.async_level:
                break  # its retired set needs the steps before k - S done
            if k == 0:
                self.loop.update(start=now, busy_start=engine_busy_s(self.urls["engine"]), cpu_start=machine_cpu(),
                                 stages_start=node_stage_totals(self.urls.get("gateway")))
            steps_out[k] = (self.send([self.step_task(k, i) for i in range(self.per_step)]), now)
        return (f"eval of version {', '.join(map(str, evals.out))}" if evals.out else
                f"step {len(results) + 1}/{cfg.steps}: {len(steps_out) - len(results)} in flight" if len(results) < cfg.steps
                else "final eval")

    def summary_extra(self) -> dict:
        """What the report adds for the run: the loop's figures, per-task statistics, every eval, retired tasks."""
        cfg = self.cfg
        trained = {g: self.item(r.step, self.index(g)) for r in self.results for g in r.group_ids}
        # the last version's sync is published once the engines serve it, a moment after the version itself
        fill_syncs(self.results, self.watcher.policies)
        deadline = time.monotonic() + SYNC_WAIT_S
        while self.results and self.results[-1].sync_s is None and time.monotonic() < deadline:
            self.watcher.poll(0.2)
            fill_syncs(self.results, self.watcher.policies)
        return {**loop_figures(self.loop, cfg.steps), "per_task": per_task(trained, self.watcher.groups),
                "heldout_metrics": self.evals.metrics,
                "retired": sorted(retired(self.history(len(self.results)), cfg.retire, cfg.retire_after))}
