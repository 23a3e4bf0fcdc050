"""The loop every run goes through (``polarstream run``; the demo is one such run, polarstream/demo/).

Kafka, the S3 server, the engine, a gateway node with its sandboxed harness runs, the Faust stream
worker, the trainer and the rollout server all run as their own processes, exactly as a user would run
them; this module only starts them (or some of them: ``--only``; none: ``--driver-only``), submits each
step's tasks under the bounded-asynchrony schedule (producers/driver.py: S = 0 submits a step once the
weights trained on the previous one are served), watches the topics and writes the report.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx

from infra.process import machine_cpu
from infra.settings import Settings
from schemas import HarnessSpec, Parts, PolicyVersion, TaskRequest, TrainingGroup, derived_event_id

from producers.driver import (Curriculum, Schedule, eval_tag, outcome, replacement, replacements_due, retired, step_batches,
                              step_tag, submitted, task_id, zero_signal_wish)

from .config import RunConfig, StepResult
from .demo import arith
from .demo.model import demo_model
from .demo.shape import harness_config
from .processes import Processes, ProcessFailed

if TYPE_CHECKING:
    from .tracking import Tracker


HELDOUT_SET = "demo-heldout"


def pick_runtime(requested: str) -> str:
    if requested != "auto":
        return requested
    return "bwrap" if shutil.which("bwrap") else "subprocess"


class Watcher:
    """Reads polar.tasks, polar.groups and polar.policy from their beginning as the demo's own consumer
    (deduplicated by event_id): what the run sent out and what came back, so a restarted driver knows
    where its run stands (producers/driver.py)."""

    def __init__(self, settings: Settings):
        from producers.consumer import Deduper, RecordConsumer

        self.settings = settings
        self.consumer = RecordConsumer(settings, topics=["tasks", "groups", "policy"],
                                       group_id=f"polar-demo-{uuid.uuid4().hex[:8]}")
        self.dedupe = Deduper()
        self.tasks: dict[str, int] = {}  # group id -> when its task reached polar.tasks (ms)
        self.groups: dict[str, TrainingGroup] = {}
        self.parts = Parts()
        self.policy: PolicyVersion | None = None
        self.policies: dict[int, PolicyVersion] = {}
        self._read: dict[tuple[str, int], int] = {}  # (topic, partition) -> next offset

    def poll(self, timeout: float = 0.5) -> None:
        for item in self.consumer.poll(timeout):
            self._read[(item.logical_topic, item.partition)] = item.offset + 1
            rec = item.record
            if self.dedupe.seen(rec.event_id):
                continue
            if isinstance(rec, TaskRequest):
                self.tasks.setdefault(rec.group_id, item.timestamp_ms)
            elif isinstance(rec, TrainingGroup):
                whole = self.parts.add(rec)  # a group sent in parts counts once all of them are in
                if whole is not None:
                    self.groups[whole.group_id] = whole
            elif isinstance(rec, PolicyVersion):
                self.policies[rec.version] = rec
                if self.policy is None or rec.version >= self.policy.version:
                    self.policy = rec

    def catch_up(self, timeout: float = 60.0) -> None:
        """Poll until everything on the three topics when this was called has been read."""
        from producers.kafka_read import plan_spans

        ends = {(sp.topic, sp.partition): sp.end for sp in plan_spans(self.settings, ("tasks", "groups", "policy"))}
        deadline = time.monotonic() + timeout
        while True:
            at = self.consumer.positions()  # the position also steps over control records
            at.update({tp: max(o, at.get(tp, 0)) for tp, o in self._read.items()})
            if all(at.get(tp, 0) >= end for tp, end in ends.items() if end > 0):
                return
            if time.monotonic() > deadline:
                raise ProcessFailed(f"could not read the run's topics back within {timeout:.0f}s")
            self.poll()

    def close(self) -> None:
        self.consumer.close()


def consumer_lag(settings: Settings) -> dict[str, int]:
    """Per topic: messages not yet committed by the slowest consumer group that reads it."""
    from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(settings.kafka_config())
    lag: dict[str, int] = {}
    try:
        groups = admin.list_consumer_groups(request_timeout=5).result().valid
        names = [g.group_id for g in groups if not g.group_id.startswith("polar-demo-")]
        meta = admin.list_topics(timeout=5).topics
        ours = {settings.topic(t) for t in ("sessions", "calls", "session-events", "groups")}
        from confluent_kafka import Consumer

        probe = Consumer(settings.kafka_config(**{"group.id": "polar-demo-lag-probe"}))
        try:
            for name in names:
                res = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(name)])[name].result()
                for tp in res.topic_partitions:
                    if tp.topic not in ours or tp.offset < 0 or tp.topic not in meta:
                        continue
                    high = probe.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), timeout=5)[1]
                    logical = tp.topic.removeprefix(settings.topic_prefix)
                    lag[logical] = max(lag.get(logical, 0), high - tp.offset)
        finally:
            probe.close()
    except Exception:  # lag is a display nicety; never let it stop the run
        pass
    return lag


def _step_result(step: int, groups: list[TrainingGroup], wall_s: float, version: int,
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
        all_correct=sum(outcome([t.reward for t in g.trajectories]) == "solved" for g in flat),
        all_wrong=sum(outcome([t.reward for t in g.trajectories]) == "unsolved" for g in flat),
        replaced=len(dropped),
    )


def _view(cfg: RunConfig, results: list[StepResult], lag: dict[str, int], status: str,
          heldout: dict[str, float] | None = None):
    from rich.table import Table

    t = Table(title=f"polarstream {cfg.name} - {status}", expand=False)
    for col in ("step", "reward", "entropy", "grad norm", "samples", "tokens/s", "merge rate", "policy"):
        t.add_column(col, justify="right")
    from .report import dash

    for r in results[-12:]:
        t.add_row(str(r.step), f"{r.reward:.2f}", dash(r.entropy, ".3f"), dash(r.grad_norm, ".2f"), str(r.samples),
                  f"{r.sampled_tokens / max(r.wall_s, 1e-9):.0f}", f"{r.merge_rate:.0%}", str(r.policy_version))
    held = ", ".join(f"{k} {v:.2f}" for k, v in (heldout or {}).items()) or "-"
    t.caption = (f"held-out pass@1: {held}\n"
                 "consumer lag: " + (", ".join(f"{k}={v}" for k, v in sorted(lag.items())) or "-"))
    return t


def serving(engine_url: str) -> int:
    """The policy version the engine serves now (-1 while it cannot say)."""
    try:
        return int(httpx.get(f"{engine_url}/policy_version", timeout=5).json()["policy_version"])
    except (httpx.HTTPError, KeyError, ValueError):
        return -1


def engine_busy_s(engine_url: str) -> float | None:
    """Seconds the engine has spent generating (its GET /stats), or None when it cannot say."""
    try:
        return float(httpx.get(f"{engine_url}/stats", timeout=5).json()["busy_s"])
    except (httpx.HTTPError, KeyError, ValueError, TypeError):
        return None


def heldout_metrics(settings: Settings, samples: int) -> dict[int, dict[str, float]]:
    """The held-out task set's pass@1, pass@n (unbiased, n = ``samples``) and avg@n (mean reward) per policy
    version, from polar.trajectories through the ``polarstream eval`` reader (the same report a user gets),
    with failed and infra-error samples counted as not passing."""
    from .tools.eval_run import run_eval

    report = run_eval(settings, ks=(1, samples), failures_fail=True)  # a broken sandbox scores 0, not nothing
    return {c["policy_version"]: {"pass@1": c["pass@1"], f"pass@{samples}": c[f"pass@{samples}"],
                                  f"avg@{samples}": c["mean_reward"]}
            for c in report["cells"] if c["task_set"] == HELDOUT_SET}


def task_payload(item: tuple[str, str] | TaskRequest, task_id: str, samples: int, task_set: str, harness: HarnessSpec,
                 tool: str = "write_file", min_completion: float = 0.5, early_stop_at: float = 0.0,
                 zero_signal: str = "mask") -> dict:
    """The TaskRequest sent for one train or eval task: an arith problem, or a user's task template with the
    run's sampling. A group counts once ``min_completion`` of its samples (rounded down, at least 1) are
    usable; with ``early_stop_at`` > 0 the rollout server cancels the stragglers once that fraction
    (rounded up) is; a task that sets its own ``min_valid`` or ``early_stop`` keeps it. ``zero_signal``: what the
    trainer does with the group if it has no signal."""
    if isinstance(item, TaskRequest):  # a user's task: its own workspace and evaluator
        # its own event id: copies of one template share the template's, and consumers dedupe on it
        req = item.model_copy(update={"event_id": derived_event_id("task", task_id), "task_id": task_id,
                                      "group_id": task_id, "num_samples": samples, "harness": harness, "task_set": task_set,
                                      "metadata": {**item.metadata, "source_task_id": item.task_id}})
    else:
        q, a = item
        req = arith.task_request(q, a, task_id=task_id, num_samples=samples, harness=harness, task_set=task_set,
                                      tool=tool)
    # a task that names its own minimum or early stop keeps it (at most the run's group size); the rest take the run's
    own = item.model_fields_set if isinstance(item, TaskRequest) else set()
    req.min_valid = min(item.min_valid, samples) if "min_valid" in own else max(1, int(min_completion * samples))
    req.early_stop = (min(item.early_stop, samples) if "early_stop" in own else
                      math.ceil(early_stop_at * samples) if early_stop_at > 0 else 0)
    req.early_stop = max(req.min_valid, req.early_stop) if req.early_stop else 0
    req.zero_signal = zero_signal
    return req.model_dump(mode="json")


def task_name(item: tuple[str, str] | TaskRequest) -> str:
    """A train task's name in per-task statistics and the curriculum: its id, or an arith problem's question."""
    return item.task_id if isinstance(item, TaskRequest) else item[0]


def per_task(trained: dict[str, tuple[str, str] | TaskRequest], groups: dict[str, TrainingGroup]) -> dict[str, dict]:
    """Per train task (its id, or an arith problem's question): the groups trained on it and their mean
    reward, in the order first trained; the curriculum's view of which tasks are solved or still hard."""
    stats: dict[str, list[float]] = {}
    for gid, item in trained.items():
        name = task_name(item)
        group = groups.get(gid)
        if group is not None and group.trajectories:
            stats.setdefault(name, []).append(sum(t.reward for t in group.trajectories) / len(group.trajectories))
    return {name: {"groups": len(r), "mean_reward": round(sum(r) / len(r), 3)} for name, r in stats.items()}


def _loop_figures(loop: dict, steps: int) -> dict:
    """steps/hour over the training loop, the engine's idle fraction in it, and how many of the machine's
    cores everything on it kept busy meanwhile (what overlap can still use: bench/driver.py) (None where
    unmeasured)."""
    span = loop["end"] - loop["start"] if {"start", "end"} <= loop.keys() else None
    busy = (loop["busy_end"] - loop["busy_start"]) if None not in (loop.get("busy_start"), loop.get("busy_end")) else None
    cpu = (loop.get("cpu_start"), loop.get("cpu_end"))
    cores = cpu[1][2] if cpu[1] else None
    busy_cores = ((cpu[1][0] - cpu[0][0]) / (cpu[1][1] - cpu[0][1]) * cores
                  if None not in cpu and cpu[1][1] > cpu[0][1] else None)
    return {"rl_loop_s": round(span, 1) if span else None,
            "steps_per_hour": round(steps / span * 3600, 1) if span else None,
            "engine_idle_fraction": round(max(0.0, 1 - busy / span), 3) if span and busy is not None else None,
            "machine_busy_cores": round(busy_cores, 3) if busy_cores is not None else None, "cores": cores}


# What a run starts, in this order; ``polarstream run --only`` starts some of them on one machine
COMPONENTS = ("ui", "engine", "node", "streams", "trainer", "rollout")
# The components other machines reach, and the URL (in RunConfig.attach, the experiment's *_url) they use
SERVES = {"engine": "engine", "node": "gateway", "rollout": "rollout"}


def _start_components(cfg: RunConfig, settings: Settings, procs: Processes, ports: dict[str, int], urls: dict[str, str],
                      model_dir: Path, runtime: str, run_dir: Path, console, only: Sequence[str] = COMPONENTS) -> None:
    """The viewer, engine, gateway node, stream worker, trainer and rollout server (those in ``only``), each
    its own process (adopted instead where a killed driver of this run left it running)."""
    # The viewer before the services: it follows the run's topics from their creation on (with the
    # model's tokenizer, so traces read as text).
    if "ui" in only:
        ui = procs.start("ui", "ui", "--port", str(ports["ui"]), "--model", str(model_dir))
        procs.wait_http(ui, f"{urls['ui']}/seq")
        console.print(f"viewer: [bold]{urls['ui']}/[/]  (groups, sessions with their chains, traces; live)")
    with console.status(f"starting {', '.join(c for c in COMPONENTS[1:] if c in only)}"):
        if "engine" in only:
            engine = procs.start("engine", "engine", "--model", str(model_dir), "--port", str(ports["engine"]),
                                 "--seed", str(cfg.seed), "--threads", "1")
            procs.wait_http(engine, f"{urls['engine']}/health")
        if "node" in only:
            node = procs.start("node", "node", "--engine-url", urls["engine"], "--model", str(model_dir),
                               "--runtime", runtime, "--port", str(ports["gateway"]), "--run-workers", "4",
                               "--init-workers", "4", "--ready-target", "4", "--postrun-workers", "4",
                               "--temperature", str(cfg.temperature))  # pinned: the trainer's temperature
            procs.wait_http(node, f"{urls['gateway']}/health")
        if "streams" in only:
            procs.start("streams", "streams", "worker", "--builder", "prefix_merging", "--group-deadline", "120",
                        "--missing-calls-grace", "10", "--stats-interval", "2",
                        "--metrics-port", str(ports["streams_metrics"]))
        if "trainer" in only:
            procs.start("trainer", "train", "--model", str(model_dir), "--groups-per-step", str(cfg.tasks_per_step),
                        "--max-steps", str(cfg.steps), "--lr", str(cfg.lr), "--engine", f"polar={urls['engine']}",
                        "--gateway", urls["gateway"], "--run-dir", str(run_dir / "trainer"),
                        "--storage-url", settings.storage_url, "--metrics-port", str(ports["trainer_metrics"]),
                        # a group where every sample scored the same still closes the demo's on-policy step;
                        # the trainer publishes the step but leaves the weights untouched (no signal)
                        "--set", "skip_zero_variance=false", "--set", "weight_decay=0.0",
                        "--set", f"temperature={cfg.temperature}",
                        # the driver's bound, enforced again where the groups are trained (one setting for both).
                        # Groups finish out of order, so one of step k can reach the trainer after step k+1's,
                        # a version later than the bound: it is down-weighted (0.5 per version past S), not
                        # dropped, since a dropped group would leave its step a group short for good.
                        "--set", f"max_staleness={cfg.async_level}", "--set", "stale_mode=downweight",
                        # held-out groups are for evaluation only: the trainer consumes and skips them
                        "--set", f"skip_task_sets={HELDOUT_SET}",
                        # the experiment's own trainer settings (polarstream run checked that none of the above)
                        *[a for k, v in cfg.trainer_settings.items() for a in ("--set", f"{k}={v}")])
        if "rollout" in only:
            rollout = procs.start("rollout", "rollout", "--port", str(ports["rollout"]))
            procs.wait_http(rollout, f"{urls['rollout']}/health")


class Steps:
    """The run's steps and evals from submission to result: which tasks go out when (the schedule, the
    curriculum, a replacement for each dropped group), what came back (the Watcher's topics), and where a
    restarted driver stands (what an earlier one sent is waited for, not sent again)."""

    def __init__(self, cfg: RunConfig, run_id: str, settings: Settings, watcher: Watcher, procs: Processes,
                 tracker: Tracker, urls: dict[str, str], train: list, heldout: list, harness: HarnessSpec, tool: str):
        self.cfg, self.run_id, self.settings, self.watcher, self.procs, self.tracker = cfg, run_id, settings, watcher, procs, tracker
        self.urls, self.train, self.heldout, self.harness, self.tool = urls, train, heldout, harness, tool
        self.curriculum = Curriculum(train, cfg.seed, cfg.order, cfg.tasks_per_step, task_name) if cfg.retire != "none" else None
        self.batches = (self.curriculum.batches if self.curriculum
                        else step_batches(train, cfg.seed, cfg.steps, cfg.tasks_per_step, cfg.order))
        self.per_step, self.replacing = cfg.tasks_per_step, cfg.zero_signal == "replace"
        self.schedule = Schedule(steps=cfg.steps, async_level=cfg.async_level, eval_every=cfg.eval_every,
                                 evaluate=bool(heldout) and cfg.heldout_samples > 0)
        self.results: list[StepResult] = []
        self.steps_out: dict[int, tuple[set[str], float]] = {}  # step -> (its groups, when they went out)
        self.evals_out: dict[int, tuple[set[str], float]] = {}  # policy version -> (its eval groups, when)
        self.evaluated: dict[int, float] = {}  # policy version -> held-out pass@1
        self.held: dict[str, float] = {}  # "before", "step k", "after" -> pass@1
        self.held_metrics: dict[str, dict[str, float]] = {}  # ... -> pass@1, pass@n and avg@n
        self.lag: dict[str, int] = {}
        # The training loop's span (first step out -> last step trained) and the engine's busy seconds in it:
        # steps per hour and the engine's idle fraction there (bench/driver.py compares async levels on them).
        self.loop: dict[str, float | None] = {}
        self.t_resume = time.monotonic()

    def item(self, k: int, i: int) -> tuple[str, str] | TaskRequest:
        """Task ``i`` of step ``k``: its own ``per_step`` first, then its replacements (producers/driver.py)."""
        cfg = self.cfg
        while len(self.batches) <= k:  # the curriculum draws steps in order, each with its own retired set
            self.curriculum.draw(retired(self.history(len(self.batches) - cfg.async_level), cfg.retire, cfg.retire_after))
        if i < self.per_step:
            return self.batches[k][i]
        gone = self.curriculum.retired[k] if self.curriculum else set()
        return replacement([t for t in self.train if task_name(t) not in gone], cfg.seed, k, i - self.per_step)

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
                    seen.setdefault(task_name(self.item(k, i)), []).append(outcome([t.reward for t in group.trajectories]))
        return seen

    def step_task(self, k: int, i: int) -> dict:
        cfg = self.cfg
        wish = zero_signal_wish(i, self.per_step, cfg.replace_cap) if self.replacing else "mask"
        return task_payload(self.item(k, i), task_id(self.run_id, step_tag(k), i), cfg.samples, cfg.task_set, self.harness,
                            self.tool, cfg.min_completion, cfg.early_stop_at, wish)

    def eval_tasks(self, v: int) -> list[dict]:  # every sample runs (no straggler early stop): pass@n needs n
        return [task_payload(p, task_id(self.run_id, eval_tag(v), i), self.cfg.heldout_samples, HELDOUT_SET, self.harness,
                             self.tool, self.cfg.min_completion) for i, p in enumerate(self.heldout)]

    def send(self, tasks: list[dict], one_by_one: bool = False) -> set[str]:
        """Post tasks to the rollout server. ``one_by_one`` where some may be on polar.tasks already (a
        restarted driver's, a replacement): the server refuses those (409), which is no error."""
        if not one_by_one:
            httpx.post(f"{self.urls['rollout']}/tasks", json=tasks, timeout=60).raise_for_status()
        for t in tasks if one_by_one else ():
            r = httpx.post(f"{self.urls['rollout']}/tasks", json=[t], timeout=60)
            if r.status_code != 409:
                r.raise_for_status()
        return {t["group_id"] for t in tasks}

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

    def label(self, v: int) -> str:
        return "before" if v == 0 else "after" if v == self.cfg.steps else f"step {v}"

    @property
    def done(self) -> bool:
        return len(self.results) >= self.cfg.steps and set(self.evaluated) >= set(self.schedule.eval_versions())

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
            self.evals_out[v] = (ids, sent_at(ids))
        return len(sent_steps), len(sent_evals)

    def tick(self, on_step: Callable[[int, dict[str, str]], None] | None, metrics: dict[str, str], console) -> str:
        """One round: read the topics, keep the components alive, collect finished evals and steps, send
        replacements and what the schedule allows now; returns the status line."""
        cfg, watcher, results, steps_out, evals_out = self.cfg, self.watcher, self.results, self.steps_out, self.evals_out
        watcher.poll()
        trained = watcher.policy.version if watcher.policy is not None else 0
        # after its last step the trainer is done (it stops at --max-steps); the rest must live. A
        # trainer that dies mid-run is started again: it resumes from its newest checkpoint.
        for name in self.procs.check_all(finished_ok=frozenset({"trainer"}) if trained >= cfg.steps else frozenset(),
                                         restart=frozenset({"trainer"})):
            console.print(f"{name} exited; started it again (it resumes from its newest checkpoint)")
        # the version the engine serves now: a step goes out on-policy only once its weights are loaded
        served = min(trained, serving(self.urls["engine"])) if trained else 0
        now = time.monotonic()
        for v, (wanted, started) in list(evals_out.items()):
            if wanted <= watcher.groups.keys():  # its eval is in: pass@1 at that version (polarstream eval)
                scores = heldout_metrics(self.settings, cfg.heldout_samples).get(v) or {"pass@1": 0.0}
                self.evaluated[v] = scores["pass@1"]
                self.held[self.label(v)], self.held_metrics[self.label(v)] = self.evaluated[v], scores
                self.tracker.eval(v, scores)
                del evals_out[v]
            elif now - max(started, self.t_resume) > cfg.step_timeout_s:
                raise ProcessFailed(f"held-out eval of version {v} did not finish within {cfg.step_timeout_s:.0f}s "
                                    f"(groups {len(wanted & watcher.groups.keys())}/{len(wanted)}); logs in {self.procs.log_dir}")
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
            results.append(_step_result(k, [watcher.groups[g] for g in sorted(wanted) if not self.dropped(g)], now - started,
                                        watcher.policy.version, watcher.policies.get(k + 1),
                                        [watcher.groups[g] for g in sorted(wanted) if self.dropped(g)]))
            r = results[-1]
            self.tracker.step(k + 1, r.reward, r.groups, r.all_correct, r.all_wrong, r.replaced)
            if len(results) == cfg.steps:
                self.loop.update(end=now, busy_end=engine_busy_s(self.urls["engine"]), cpu_end=machine_cpu())
            if on_step is not None:
                on_step(k, metrics)
            self.lag = consumer_lag(self.settings)
        if (v := self.schedule.due_eval(served, set(self.evaluated), set(evals_out))) is not None:
            evals_out[v] = (self.send(self.eval_tasks(v)), now)
        for k in self.schedule.due_steps(len(steps_out), served, set(self.evaluated)):
            if self.curriculum and len(results) < k - cfg.async_level:
                break  # its retired set needs the steps before k - S done
            if k == 0:
                self.loop.update(start=now, busy_start=engine_busy_s(self.urls["engine"]), cpu_start=machine_cpu())
            steps_out[k] = (self.send([self.step_task(k, i) for i in range(self.per_step)]), now)
        return (f"eval of version {', '.join(map(str, evals_out))}" if evals_out else
                f"step {len(results) + 1}/{cfg.steps}: {len(steps_out) - len(results)} in flight" if len(results) < cfg.steps
                else "final eval")

    def summary_extra(self) -> dict:
        """What the report adds for the run: the loop's figures, per-task statistics, every eval, retired tasks."""
        cfg = self.cfg
        trained = {g: self.item(r.step, self.index(g)) for r in self.results for g in r.group_ids}
        return {**_loop_figures(self.loop, cfg.steps), "per_task": per_task(trained, self.watcher.groups),
                "heldout_metrics": self.held_metrics,
                "retired": sorted(retired(self.history(len(self.results)), cfg.retire, cfg.retire_after))}


def _serve(cfg: RunConfig, procs: Processes, urls: dict[str, str], console) -> None:
    """``--only``: keep this machine's components running (a trainer that dies is started again, and one
    that finished its steps may exit) until all have exited or the command is interrupted."""
    console.print(f"running {', '.join(c for c in COMPONENTS if c in cfg.only)} of run {cfg.run_id} "
                  f"({', '.join(f'{SERVES[c]} {urls[SERVES[c]]}' for c in COMPONENTS if c in cfg.only and c in SERVES) or 'no URL'}); "
                  "Ctrl-C stops them")
    while any(c.proc.poll() is None for c in procs.children):
        for name in procs.check_all(finished_ok=frozenset({"trainer"}), restart=frozenset({"trainer"})):
            console.print(f"{name} exited; started it again (it resumes from its newest checkpoint)")
        time.sleep(1.0)


def run(cfg: RunConfig, settings: Settings | None = None,
        on_step: Callable[[int, dict[str, str]], None] | None = None) -> Path | None:
    """Run ``cfg``; returns the path of demo-summary.json (None with ``cfg.only``: components served
    until they exit or the command is interrupted).

    ``on_step(step, metrics_urls)`` runs after each training step while every service is up; the
    URLs are each service's ``/metrics`` by name (the test parses them mid-run).
    """
    from rich.console import Console
    from rich.live import Live

    from infra.stack import Stack

    from .report import write_report
    from .tracking import Tracker

    console = Console()
    run_dir = cfg.run_dir.absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    # Unique per run, so topics and checkpoints of earlier runs on the same cluster never mix in.
    run_id = cfg.run_id or f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    base = settings or Settings()
    settings = base.model_copy(update={
        "topic_prefix": base.topic_prefix or f"{run_id}.",
        "storage_url": base.storage_url or f"s3://{base.s3_bucket}/{run_id}",
    })
    t_start = time.monotonic()
    console.print(f"[bold]polarstream {cfg.name}[/] -> {run_dir}")
    if not cfg.attach and not cfg.only:
        with console.status("bringing up Kafka and the S3 server (first run fetches jars from Maven Central)"):
            Stack(settings).up()
    else:  # Kafka runs elsewhere: the run's topics must exist whichever part of the run starts first
        from infra.reach import require_kafka
        from infra.topics import ensure_topics

        require_kafka(settings, wait_s=settings.wait_for_s)
        ensure_topics(settings)
    env = {
        "POLAR_KAFKA_BOOTSTRAP": settings.kafka_bootstrap, "POLAR_TOPIC_PREFIX": settings.topic_prefix,
        "POLAR_STORAGE_URL": settings.storage_url, "POLAR_S3_PORT": str(settings.s3_port),
        "POLAR_S3_ENDPOINT": settings.s3_endpoint_url, "POLAR_DATA_DIR": str(run_dir / "data"),
        "POLAR_SESSION_SECRET": settings.session_secret, "POLAR_ADMIN_TOKEN": settings.admin_token,
        "OMP_NUM_THREADS": "1",
    }
    # A named run keeps its components' pids and ports, so a driver started again adopts those still running.
    procs = Processes(run_dir / "logs", env,
                      registry=run_dir / "components.json" if cfg.run_id and (cfg.only or not cfg.attach) else None)
    watcher: Watcher | None = None
    results: list[StepResult] = []
    ports = {name: procs.port(name) for name in ("engine", "gateway", "rollout", "ui", "streams_metrics", "trainer_metrics")}
    for name in cfg.only & SERVES.keys():  # served where the experiment's URL says the others will find it
        ports[SERVES[name]] = urlsplit(cfg.attach[SERVES[name]]).port or ports[SERVES[name]]
    # what runs on this machine: everything, nothing (--driver-only), or the --only components
    here = ({SERVES.get(name, name) for name in cfg.only} | {"streams_metrics", "trainer_metrics"} if cfg.only
            else set() if cfg.attach else set(ports))
    urls = {name: f"http://127.0.0.1:{port}" if name in here else "" for name, port in ports.items()}
    urls.update({k: v for k, v in cfg.attach.items() if k not in here})
    metrics = {"gateway": f"{urls['gateway']}/metrics", "rollout": f"{urls['rollout']}/metrics",
               "streams": f"{urls['streams_metrics']}/metrics", "trainer": f"{urls['trainer_metrics']}/metrics"}
    runtime = pick_runtime(cfg.runtime)
    tracker: Tracker | None = None
    try:
        tracker = Tracker(run_dir, run_id, cfg.wandb, {"run_id": run_id, "seed": cfg.seed, "steps": cfg.steps,
                                                       "async_level": cfg.async_level, "lr": cfg.lr})
        if cfg.train_tasks is not None:
            train, heldout = list(cfg.train_tasks), list(cfg.eval_tasks or [])
        else:
            train, heldout = arith.split(cfg.seed, cfg.heldout)
        shape = None
        if cfg.attach and cfg.harness != "builtin" and not cfg.model:
            raise ProcessFailed("--driver-only and --only run a real CLI only with the experiment's own model (the "
                                "arith family's warm start for a CLI is made where all the components start)")
        if cfg.harness != "builtin" and not cfg.model:
            from infra.models import ensure_model

            from .demo.capture import capture

            with console.status(f"capturing {cfg.harness}'s requests through the gateway (once per CLI version and API)"):
                shape = capture(cfg.harness, cfg.api, settings, env, run_dir, ensure_model("tiny"), runtime)
            console.print(f"{cfg.harness} {shape.version} over {shape.api}: a system prompt of "
                          f"{len(shape.first[0].get('content') or '')} characters, tools {[t['name'] for t in shape.tools]}")
        if cfg.model or (cfg.attach and not cfg.only):  # a user's model, or the one the components elsewhere serve
            # polarstream/run.py resolved it once (infra.models.local_model_dir) for every component started here
            model_dir = Path(cfg.model) if cfg.model else Path("(the engine's model)")
            warm = {"train_pass_rate": None, "working_correct": None}
        else:
            with console.status("warm start: supervised fine-tuning of the tiny model (first run only, then cached)"):
                model_dir, warm = demo_model(cfg, settings, train, shape)
        if warm["train_pass_rate"] is not None:
            console.print(f"warm start: train-split pass rate {warm['train_pass_rate']:.3f} before RL, sums right "
                          f"{warm.get('working_correct', float('nan')):.3f} of the time ({model_dir.name})")
        if warm["train_pass_rate"] is not None and warm["train_pass_rate"] < cfg.min_pass_rate:
            raise ProcessFailed(f"the warm-started model solves {warm['train_pass_rate']:.3f} of the train tasks "
                                f"(< {cfg.min_pass_rate}): RL would have no signal; change --seed or the warm start")
        t0 = time.monotonic()  # the run proper: everything after the (cached) warm start
        if cfg.only:  # some components here; the driver and the rest run elsewhere
            _start_components(cfg, settings, procs, ports, urls, model_dir, runtime, run_dir, console, cfg.only)
            _serve(cfg, procs, urls, console)
            return None
        if cfg.attach:  # --driver-only: they run elsewhere; this process only drives them
            console.print(f"driving the components at {', '.join(f'{k} {v}' for k, v in cfg.attach.items())}")
        else:
            _start_components(cfg, settings, procs, ports, urls, model_dir, runtime, run_dir, console)
        watcher = Watcher(settings)
        # Every answer is capped at 48 tokens (a tool call takes about 36). Without a cap, text the tiny model
        # rambles around a correct call costs nothing, so GRPO reinforces it with the call until the policy
        # degenerates (a pi run without the cap did, on seed 1); with it, a rambling answer is cut before its
        # call closes and scores 0.
        if cfg.model:  # a user's run: their harness with its own settings
            harness = HarnessSpec(name=cfg.harness, config=cfg.harness_config)
        elif shape is None:
            harness = HarnessSpec(name=cfg.harness, config={"temperature": cfg.temperature, "max_tokens": 48, "max_turns": 3})
        else:  # a real CLI sends its own settings; the node pins the run's temperature on every call
            harness = HarnessSpec(name=cfg.harness, config=harness_config(cfg.harness, cfg.api))
        tool = shape.tool if shape is not None else "write_file"

        steps = Steps(cfg, run_id, settings, watcher, procs, tracker, urls, train, heldout, harness, tool)
        sent_steps, sent_evals = steps.resume()
        if sent_steps or sent_evals:
            console.print(f"resuming {run_id}: {sent_steps} steps and {sent_evals} evals were sent; "
                          f"components adopted: {', '.join(procs.adopted) or 'none'}")
        with Live(_view(cfg, steps.results, steps.lag, "starting", steps.held), console=console, refresh_per_second=2) as live:
            while not steps.done:
                status = steps.tick(on_step, metrics, console)
                live.update(_view(cfg, steps.results, steps.lag, status, steps.held))
            live.update(_view(cfg, steps.results, steps.lag, "done", steps.held))
        summary = write_report(run_dir, cfg, steps.results, watcher.policy, settings, time.monotonic() - t0, model_dir,
                               heldout=steps.held, warm=warm, total_s=time.monotonic() - t_start, viewer_url=urls["ui"],
                               extra=steps.summary_extra())
    finally:
        if watcher is not None:
            watcher.close()
        if tracker is not None:
            tracker.close()
        procs.stop_all()
    return summary
