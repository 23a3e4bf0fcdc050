"""Kill anything, lose nothing: random SIGKILLs across the whole pipeline, checked against an uninterrupted run.

Starts Kafka (3 brokers, replication factor 3, min.insync.replicas 2; ``--brokers 1``: one broker),
the S3 server (s3proxy) and a scripted engine, then runs one workload twice through the real pipeline
(rollout server, two gateway nodes, a Faust streams worker, the trainer with a checkpoint to s3:// after
every step), each run under its own topic prefix and checkpoint root:

1. **chaos**: tasks are submitted one every few seconds while a kill comes every few seconds: a random
   component (node, streams worker, trainer, Kafka broker, S3 server; each kind once per shuffled
   round) gets SIGKILL (a node with its harness processes, as a crashed machine), stays down 0.5-2.5 s
   and is started again; kills stop at ``--kills`` and submissions with them. Whatever else exits
   (the trainer when S3 is down, say) is restarted too, and counted.
2. **reference**: the same tasks, nothing killed.

The workload is timing-independent, so the two runs must train the same groups: the engine is scripted
and frozen (the nodes' engine gets no weights; ``--max-num-seqs 1`` and no prefix cache keep logprobs
bit-identical), and each session (bench/_chaos_agent.py) makes 2-4 calls decided by its sample index
and keeps a ledger of the answers it received. At the end, per run:

- every acknowledged call (a ledger id, ``chatcmpl-<event_id>``) is on polar.calls exactly once, and
  the calls of attempts that died with their node are recorded but never trained (their re-runs are);
- every trained session's traces hold exactly its answered calls (``trained_sessions_with_holes``: 0);
- each task's group is trained exactly once (the trainer's effective steps, after its restarts);
- the trained groups hash equal to the reference's (sha256 over each member's sample index, token ids,
  loss mask, logprobs and advantage), and the trainer's last checkpoint has consumed polar.groups to
  its end.

A kill during a weight sync: the chaos run's trainer also syncs every step, by broadcast (the default
path), to an engine of its own that no node samples from (so the groups stay the reference's), each sync
slowed to about a second (1 MiB buffers, a pause after each); the trainer's kill waits until that engine is
receiving a transfer. The engine must roll back and then serve the last step's version, synced by the
restarted trainer (``sync``: ``mid_transfer``, ``version_served``, ``last_step_version``).

Prints one JSON object; top-level ``kills``, ``acked_calls_lost``, ``groups_trained_twice``,
``groups_skipped``, ``hashes_equal`` are the issue's figures; ``recovery_s`` is kill-to-healthy per
component, ``masked_samples`` the members left out of trained groups.

    .venv/bin/python bench/chaos.py [--quick] [--seed N] [--kills N] [--brokers 1|3]
"""

from __future__ import annotations

MEASURES = ('gateway/', 'streams/', 'trainer/', 'producers/', 'engine/', 'schemas/', 'infra/', 'polarstream/tools/', 'bench/_chaos_agent.py')  # the code these figures describe (bench/_provenance.py)

import argparse
import collections
import contextlib
import hashlib
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psutil  # noqa: E402
import yaml  # noqa: E402

from infra.process import free_port  # noqa: E402
from infra.settings import Settings  # noqa: E402
from infra.topics import ensure_topics  # noqa: E402
from tests.streams.helpers import PolarProcess  # noqa: E402

AGENT = ROOT / "bench" / "_chaos_agent.py"
SAMPLES = 4
KINDS = ("node", "worker", "trainer", "broker", "s3")
MOMENT_WAIT_S = 30.0  # a step (and its sync) comes every few seconds while tasks are submitted
# The chaos trainer's weight sync: slow enough (~6 buffers of 1 MiB, 0.15 s after each) to be killed inside it
SYNC_SETTINGS = ("weight_transfer_buffer_mb=1", "weight_transfer_throttle_s=0.15", "weight_transfer_timeout_s=10")
SCRIPT = {"turns": [{"match": "step", "text": "Step done; moving on to the next one."}], "fallback": {"text": "Done."}}


def say(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wait_for(what: str, check: Callable[[], bool], timeout: float, poll: float = 0.2) -> float:
    """Seconds until ``check()`` holds; RuntimeError after ``timeout``."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{what}: not ready after {timeout:.0f} s")
        time.sleep(poll)
    return time.monotonic() - t0


# -- the components ------------------------------------------------------------------------------------


@dataclass
class Component:
    """Something the chaos loop can kill and start again, and ask whether it serves."""

    name: str
    kind: str
    kill: Callable[[], None]
    start: Callable[[], None]
    healthy: Callable[[], bool]
    alive: Callable[[], bool]
    finished: Callable[[], bool] = lambda: False  # exited on purpose (the trainer after its last group)
    exit_code: Callable[[], int | None] = lambda: None
    moment: Callable[[], bool] | None = None  # the kill waits (up to MOMENT_WAIT_S) until this is true


def kill_tree(proc: PolarProcess) -> None:
    """SIGKILL a process and every process under it at once (a crashed machine takes its harnesses)."""
    if proc.proc is None or proc.proc.poll() is not None:
        return
    victims = [proc.proc.pid] + [c.pid for c in psutil.Process(proc.proc.pid).children(recursive=True)]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.proc.wait(10)


def process_component(name: str, kind: str, p: PolarProcess, healthy: Callable[[], bool],
                      kill: Callable[[], None] | None = None, finished: Callable[[], bool] = lambda: False,
                      moment: Callable[[], bool] | None = None) -> Component:
    return Component(name, kind, kill=kill or p.kill, start=p.start, healthy=healthy, alive=p.alive, finished=finished,
                     exit_code=lambda: p.proc.returncode, moment=moment)


def relaunch(server) -> None:
    """Spawn a killed Java server again once the kernel has let go of its ports (it does a moment after
    the process is gone)."""
    from infra.process import port_in_use

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(port_in_use(p) for p in server.ports().values()):
        time.sleep(0.05)
    server.launch()


def log_count(proc: PolarProcess, needle: str) -> int:
    return proc.log_text().count(needle)


class Infra:
    """Kafka (one broker or a 3-broker cluster), the S3 server and the scripted engine."""

    def __init__(self, base: Path, brokers: int, model_dir: Path):
        from infra.kafka import KafkaBroker
        from infra.kafka_cluster import KafkaCluster
        from infra.maven import fetch
        from infra.s3 import S3Server

        self.base = base
        kport, s3port = free_port(), free_port()
        seed = Settings(data_dir=base, kafka_port=kport, kafka_controller_port=free_port(), s3_port=s3port, topic_prefix="")
        fetch("kafka", seed)
        if brokers > 1:
            cluster = KafkaCluster(seed, brokers, heap_mb=256, die_with_parent=True, quick_jit=True)
            self.nodes = cluster.nodes
            cluster.start(180)
        else:
            self.nodes = [KafkaBroker(seed.model_copy(update={"kafka_bootstrap": f"127.0.0.1:{kport}"}), heap_mb=384,
                                      die_with_parent=True, quick_jit=True)]
            self.nodes[0].start(120)
        self.bootstrap = ",".join(n.bootstrap for n in self.nodes)
        self.s3 = S3Server(seed, die_with_parent=True)
        self.s3.start(120)
        self.s3_port = s3port
        script = base / "script.yaml"
        script.write_text(yaml.safe_dump(SCRIPT))
        eport = free_port()
        self.engine = PolarProcess(["engine", "--model", str(model_dir), "--script", str(script), "--port", str(eport),
                                    "--max-num-seqs", "1", "--prefix-cache-mb", "0", "--threads", "1"],
                                   {**os.environ, "PYTHONPATH": str(ROOT)}, base / "engine.log").start()
        self.engine_url = f"http://127.0.0.1:{eport}"
        wait_for("engine", lambda: _answers(f"{self.engine_url}/health"), 120)

    def settings(self, prefix: str) -> Settings:
        return Settings(data_dir=self.base, kafka_bootstrap=self.bootstrap, s3_port=self.s3_port, topic_prefix=prefix,
                        storage_url=f"s3://polarstream/{prefix.rstrip('.')}")

    def components(self) -> list[Component]:
        out = []
        for i, node in enumerate(self.nodes):
            out.append(Component(f"broker {i}", "broker", kill=lambda n=node: n.stop(force=True),
                                 start=lambda n=node: relaunch(n), healthy=lambda n=node: n.answers(),
                                 alive=lambda n=node: n.pid() is not None))
        s3 = self.s3
        out.append(Component("s3", "s3", kill=lambda: s3.stop(force=True), start=lambda: relaunch(s3), healthy=s3.answers,
                             alive=lambda: s3.pid() is not None))
        return out

    def stop(self) -> None:
        self.engine.stop()
        self.s3.stop(force=True)
        for n in self.nodes:
            n.stop(force=True)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code < 500
    except httpx.HTTPError:
        return False


class Pipeline:
    """One run's rollout server, two gateway nodes, streams worker and trainer, under its own prefix."""

    def __init__(self, infra: Infra, name: str, model_dir: Path, sync: bool = False):
        self.name, self.infra = name, infra
        self.dir = infra.base / name
        self.dir.mkdir()
        self.settings = infra.settings(f"{name}.")
        ensure_topics(self.settings)
        self.ledger = self.dir / "ledger.jsonl"
        self.run_dir = self.dir / "trainer"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "POLAR_KAFKA_BOOTSTRAP": infra.bootstrap,
               "POLAR_TOPIC_PREFIX": self.settings.topic_prefix, "POLAR_DATA_DIR": str(self.dir),
               "POLAR_S3_PORT": str(infra.s3_port), "POLAR_STORAGE_URL": self.settings.storage_url}
        rport = free_port()
        self.rollout_url = f"http://127.0.0.1:{rport}"
        self.rollout = PolarProcess(["rollout", "--port", str(rport)], env, self.dir / "rollout.log")
        self.nodes = {n: PolarProcess(["node", "--node-id", n, "--engine-url", infra.engine_url, "--model", str(model_dir),
                                       "--runtime", "subprocess", "--work-dir", str(self.dir / n), "--port", str(free_port()),
                                       "--run-workers", "2", "--ready-target", "1", "--session-timeout-ms", "6000"],
                                      env, self.dir / f"{n}.log", stop_timeout_s=20) for n in ("n1", "n2")}
        self.worker = PolarProcess(["streams", "worker", "--group-deadline", "900", "--missing-calls-grace", "5",
                                    "--tick-interval", "0.5", "--session-timeout", "6", "--stats-interval", "2"],
                                   env, self.dir / "worker.log")
        # sync: the trainer's own engine (no node samples from it), loaded every step; it reads s3:// checkpoints
        self.sync_engine = self.sync_url = None
        syncing = ["--sync-every", "0"]
        if sync:
            sport = free_port()
            self.sync_url = f"http://127.0.0.1:{sport}"
            self.sync_engine = PolarProcess(["engine", "--model", str(model_dir), "--port", str(sport), "--threads", "1",
                                             "--max-num-seqs", "1", "--prefix-cache-mb", "0"],
                                            {**env, "POLAR_WEIGHT_TRANSFER_TIMEOUT_S": "10"}, self.dir / "sync-engine.log")
            syncing = ["--sync-every", "1", "--engine", f"polar={self.sync_url}",
                       *[a for kv in SYNC_SETTINGS for a in ("--set", kv)]]
        self.trainer = PolarProcess(["train", "--model", str(model_dir), "--groups-per-step", "1", *syncing,
                                     "--idle-timeout", "30", "--run-dir", str(self.run_dir), "--lr", "1e-4",
                                     "--token-budget", "1024", "--set", "poll_timeout_s=0.2", "--set", "progress=false",
                                     "--set", "tensorboard=false", "--set", "keep_checkpoints=2",
                                     "--set", "max_staleness=1000000"],  # the engine is frozen at version 0
                                    env, self.dir / "trainer.out")
        self.tasks: list[str] = []
        self.trained_at: float | None = None
        self.checkpoint_lag_s: float | None = None

    # -- lifecycle
    def start(self) -> None:
        if self.sync_engine is not None:  # before the trainer, which forms its transfer group at the first sync
            self.sync_engine.start()
        self.rollout.start()
        for n in self.nodes.values():
            n.start()
        self.worker.start()
        self.trainer.start()
        wait_for(f"{self.name} rollout", lambda: _answers(f"{self.rollout_url}/health"), 120)
        if self.sync_url:
            wait_for(f"{self.name} sync engine", lambda: _answers(f"{self.sync_url}/health"), 120)
        for nid, n in self.nodes.items():
            wait_for(f"{self.name} node {nid}", lambda n=n, nid=nid: log_count(n, f"node {nid} ready") >= n.starts, 120)
        wait_for(f"{self.name} worker", lambda: log_count(self.worker, "Worker ready") >= self.worker.starts, 120)
        # Both nodes own partitions before the first task: a rebalance under a running session re-runs it
        # (as a node loss does), which an uninterrupted run should not have.
        for nid, n in self.nodes.items():
            wait_for(f"{self.name} node {nid} partitions", lambda n=n, nid=nid: re.search(
                rf"node {nid}: assigned partitions \[\d", n.log_text()) is not None, 120)
        time.sleep(1.0)

    def stop(self) -> None:
        """Kill everything: the audit has read what it needs, and a graceful stop takes a node 20 s."""
        for p in (self.trainer, *self.nodes.values(), self.worker, self.rollout, self.sync_engine):
            if p is not None:
                kill_tree(p)

    def components(self) -> list[Component]:
        t = self.trainer
        out = [process_component(f"node {nid}", "node", n, lambda n=n, nid=nid: log_count(n, f"node {nid} ready") >= n.starts,
                                 kill=lambda n=n: kill_tree(n)) for nid, n in self.nodes.items()]
        out.append(process_component("worker", "worker", self.worker,
                                     lambda: log_count(self.worker, "Worker ready") >= self.worker.starts))
        out.append(process_component("trainer", "trainer", t, lambda: self.trainer_starts() >= t.starts or self.all_trained(),
                                     finished=lambda: not t.alive() and t.proc.returncode == 0 and self.all_trained(),
                                     moment=self.receiving if self.sync_url else None))
        return out

    # -- the weight sync
    def transfer_state(self) -> dict:
        try:
            r = httpx.get(f"{self.sync_url}/weight_info", timeout=2)
            return r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return {}

    def receiving(self) -> bool:
        """The sync engine is receiving a broadcast: the trainer is mid-transfer."""
        return bool(self.transfer_state().get("transfer", {}).get("receiving"))

    def sync_audit(self, timeout_s: float = 60.0) -> dict:
        """Whether the sync engine came to serve the last step's version (the restarted trainer synced it after
        the killed transfer), and how the trainer's syncs went."""
        log = self.trainer_log()
        steps = [r for r in log if r.get("event") == "step"]
        want = steps[-1]["policy_version"] if steps else None
        end = time.monotonic() + timeout_s
        while (served := self.transfer_state().get("policy_version")) != want and time.monotonic() < end:
            time.sleep(0.2)
        log = self.trainer_log()
        syncs = [r for r in log if r.get("event") in ("sync", "resync")]
        state = self.transfer_state().get("transfer", {})
        return {"version_served": served, "last_step_version": want,
                "syncs": dict(collections.Counter("resync" if r["event"] == "resync" else
                                                  "broadcast" if r.get("broadcast") else "storage" for r in syncs)),
                "sync_errors": sum(1 for r in log if r.get("event") == "sync_error"),
                "engine_aborted_transfers": state.get("aborted"), "engine_groups_formed": state.get("groups_formed")}

    # -- the workload
    def submit(self, task_id: str) -> None:
        task = {"task_id": task_id, "instruction": f"Task {task_id}: work through the steps.",
                "num_samples": SAMPLES, "min_valid": SAMPLES,
                "harness": {"name": "command", "command": ["{python}", str(AGENT)],
                            "config": {"env": {"CHAOS_LEDGER": str(self.ledger)}}},
                "evaluator": {"kind": "command", "command": 'test "$(cat answer.txt)" = 7'},
                "timeouts": {"agent_s": 240}}
        for attempt in range(60):  # the rollout server answers 503 while Kafka cannot take the task
            try:
                r = httpx.post(f"{self.rollout_url}/tasks", json=task, timeout=60)
                if r.status_code == 202:
                    self.tasks.append(task_id)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name}: the rollout server did not take {task_id}")

    def trainer_log(self) -> list[dict]:
        from trainer.metrics import read_log

        path = self.run_dir / "train.jsonl"
        return list(read_log(path)) if path.exists() else []

    def trainer_starts(self) -> int:
        return sum(1 for r in self.trainer_log() if r.get("event") == "start")

    def trained_groups(self) -> collections.Counter:
        from trainer.metrics import effective_steps

        return collections.Counter(g for s in effective_steps(self.trainer_log()) for g in s["groups"])

    def all_trained(self) -> bool:
        return bool(self.tasks) and sum(self.trained_groups().values()) >= len(self.tasks)

    def last_step(self) -> int:
        from trainer.metrics import effective_steps

        steps = effective_steps(self.trainer_log())
        return steps[-1]["step"] if steps else 0

    def checkpoint_step(self) -> int:
        from trainer import checkpoint

        info = checkpoint.latest(self.settings.storage_url, self.settings)
        return info.step if info else 0

    def done(self) -> bool:
        """Every task trained *and* the checkpoint of the last step written. The trainer logs a step before it
        saves that step's checkpoint (trainer/metrics.py), so a run judged on the log alone was audited while
        the last save was still going: on a loaded machine the audit read the previous checkpoint's offsets
        and reported polar.groups not consumed to its end (issue 60)."""
        if not self.all_trained():
            return False
        self.trained_at = self.trained_at or time.monotonic()
        if self.checkpoint_step() < self.last_step():
            return False
        if self.checkpoint_lag_s is None:  # how long the last checkpoint landed after its step's log line
            self.checkpoint_lag_s = round(time.monotonic() - self.trained_at, 2)
        return True


# -- the chaos loop --------------------------------------------------------------------------------------


@dataclass
class Kill:
    component: str
    kind: str
    at_s: float
    down_s: float
    recover_s: float | None = None
    at_moment: bool | None = None  # a component with a moment (the trainer: mid-transfer) was killed in it


@dataclass
class Chaos:
    components: list[Component]
    rng: random.Random
    t0: float = field(default_factory=time.monotonic)
    kills: list[Kill] = field(default_factory=list)
    restarts: collections.Counter = field(default_factory=collections.Counter)
    _order: list[str] = field(default_factory=list)

    def next_kind(self) -> str:
        if not self._order:
            self._order = list(KINDS)
            self.rng.shuffle(self._order)
        return self._order.pop()

    def kill_one(self, while_waiting: Callable[[], None] = lambda: None) -> Kill | None:
        """Kill the next kind's component; one with a moment is killed in it, ``while_waiting`` called meanwhile
        (the run's submissions: with none, the last step could pass and no sync come to be killed in)."""
        for _ in KINDS:  # a kind with nothing running to kill now gives its turn to the next one
            kind = self.next_kind()
            choices = [c for c in self.components if c.kind == kind and c.alive()]
            if choices:
                break
        else:
            return None
        c = self.rng.choice(choices)
        down = self.rng.uniform(0.5, 2.5)
        at_moment = None
        if c.moment is not None:
            at_moment, deadline = False, time.monotonic() + MOMENT_WAIT_S
            while not at_moment and time.monotonic() < deadline:
                at_moment = c.moment()
                if not at_moment:
                    while_waiting()
                    time.sleep(0.02)
        k = Kill(c.name, kind, round(time.monotonic() - self.t0, 2), round(down, 2), at_moment=at_moment)
        say(f"kill {c.name} (down {down:.1f} s{', mid-transfer' if at_moment else ''})")
        t_kill = time.monotonic()
        c.kill()
        self.kills.append(k)
        time.sleep(down)
        c.start()
        try:
            wait_for(c.name, c.healthy, 180, poll=0.1)
            k.recover_s = round(time.monotonic() - t_kill, 2)
        except RuntimeError:
            say(f"{c.name} did not come back within 180 s")
        return k

    def supervise(self) -> None:
        """Start again whatever exited that was not meant to (a kill is restarted by kill_one itself)."""
        for c in self.components:
            if not c.alive() and not c.finished():
                why = f"{c.name}, exit {c.exit_code()}"
                self.restarts[why] += 1
                say(f"{why}: starting it again")
                c.start()


def chaos_run(pipe: Pipeline, infra: Infra, rng: random.Random, kills: int, gap: tuple[float, float],
              submit_every: float, min_tasks: int, deadline_s: float) -> tuple[Chaos, float]:
    chaos = Chaos(infra.components() + pipe.components(), rng)
    t0 = time.monotonic()
    next_kill = t0 + rng.uniform(*gap)
    due = {"n": 0, "at": t0}

    def submitting() -> bool:
        return len(chaos.kills) < kills or due["n"] < min_tasks

    def submit_when_due() -> None:
        if submitting() and time.monotonic() >= due["at"]:
            pipe.submit(f"t{due['n']:03d}")
            due["n"] += 1
            due["at"] = time.monotonic() + submit_every

    while True:
        now = time.monotonic()
        submit_when_due()
        if len(chaos.kills) < kills and now >= next_kill:
            chaos.kill_one(while_waiting=submit_when_due)  # a trainer kill waits for a sync: steps must go on
            next_kill = time.monotonic() + rng.uniform(*gap)
        chaos.supervise()
        if not submitting() and pipe.done():
            break
        if now - t0 > deadline_s:
            say(f"deadline: {sum(pipe.trained_groups().values())} of {len(pipe.tasks)} groups trained")
            break
        time.sleep(0.2)
    return chaos, time.monotonic() - t0


def quiet_run(pipe: Pipeline, tasks: list[str], deadline_s: float) -> float:
    t0 = time.monotonic()
    for t in tasks:
        pipe.submit(t)
    while not pipe.done() and time.monotonic() - t0 < deadline_s:
        if not pipe.trainer.alive() and not pipe.all_trained():
            pipe.trainer.start()  # idle exit while the last groups were still on their way
        time.sleep(0.5)
    return time.monotonic() - t0


# -- the oracle ------------------------------------------------------------------------------------------


def read_all(settings: Settings, topic: str) -> list:
    from producers.kafka_read import merged, plan_spans

    return list(merged(settings, plan_spans(settings, (topic,))))


def group_hash(group) -> str:
    members = [[t.sample_index, [[tr.token_ids, tr.loss_mask, tr.logprobs] for tr in t.traces], a]
               for t, a in zip(group.trajectories, group.advantages)]
    return hashlib.sha256(json.dumps(members, separators=(",", ":")).encode()).hexdigest()


def audit(pipe: Pipeline) -> dict:
    """What one run recorded and trained, checked against its own ledger and topics."""
    from schemas import CallRecorded, TrainingGroup, decode
    from trainer import checkpoint

    recorded = [decode(m.value, CallRecorded) for m in read_all(pipe.settings, "calls")]
    calls = collections.Counter(c.event_id for c in recorded)
    ledger = [json.loads(line) for line in pipe.ledger.read_text().splitlines() if line.strip()] if pipe.ledger.exists() else []
    acked = [e["id"].removeprefix("chatcmpl-") for e in ledger if "id" in e]
    groups = {}
    raw_groups = read_all(pipe.settings, "groups")
    for m in raw_groups:
        g = decode(m.value, TrainingGroup)
        groups.setdefault(g.event_id, g)
    by_task = collections.defaultdict(set)
    for g in groups.values():
        by_task[g.task_id].add(g.event_id)
    trained = pipe.trained_groups()
    trained_by_task = collections.Counter()
    for event_id, n in trained.items():
        trained_by_task[groups[event_id].task_id if event_id in groups else f"?{event_id}"] += n
    hashes = {groups[e].task_id: group_hash(groups[e]) for e in trained if e in groups}
    trained_members = [t for e in trained if e in groups for t in groups[e].trajectories]
    trained_sessions = {t.session_id for t in trained_members}
    answered = collections.defaultdict(set)  # session -> call indices it was answered (failed calls are not)
    for c in recorded:
        if not c.error:
            answered[c.session_id].add(c.call_index)
    # A hole: a trained session whose traces leave out one of its answered calls, or hold one it never had.
    holes = sum(1 for t in trained_members if set().union(*(tr.call_indices for tr in t.traces)) != answered[t.session_id])
    info = checkpoint.latest(pipe.settings.storage_url, pipe.settings)
    consumed = checkpoint.read_state(info, pipe.settings)["offsets"].get("groups", {}) if info else {}
    ends = collections.Counter()
    for m in raw_groups:
        ends[m.partition] = max(ends[m.partition], m.offset + 1)
    return {
        "tasks": len(pipe.tasks), "calls_recorded": sum(calls.values()), "acked_calls": len(acked),
        "acked_calls_lost": sum(1 for a in acked if calls[a] == 0),
        "acked_calls_duplicated": sum(1 for a in acked if calls[a] > 1),
        "calls_failed_at_harness": sum(1 for e in ledger if "failed" in e),
        "groups_on_topic": len(groups), "group_messages": len(raw_groups),
        "tasks_with_two_groups": sum(1 for s in by_task.values() if len(s) > 1),
        "groups_trained_twice": sum(1 for n in trained_by_task.values() if n > 1),
        "groups_skipped": sum(1 for t in pipe.tasks if trained_by_task[t] == 0),
        "masked_samples": sum(len(groups[e].masked) for e in trained if e in groups),
        # calls of attempts that died with their node: recorded, never trained (their re-runs were)
        "calls_of_lost_attempts": sum(1 for c in recorded if c.session_id not in trained_sessions),
        "trained_sessions_with_holes": holes,
        "reruns": sum(1 for e in trained if e in groups for t in groups[e].trajectories if t.attempt > 0),
        "trainer_starts": pipe.trainer_starts(),
        "consumed_to_end": {int(p): o for p, o in consumed.items()} == {p: o for p, o in ends.items()} if info else False,
        # what to read when consumed_to_end is false: the checkpoint audited against the trainer's last step,
        # and the group messages past its offsets (a duplicate there was consumed and skipped, never saved)
        "checkpoint_step": info.step if info else None, "last_step": pipe.last_step(), "checkpoint_lag_s": pipe.checkpoint_lag_s,
        "group_messages_past_checkpoint": [{"partition": m.partition, "offset": m.offset, "trained": decode(m.value, TrainingGroup).event_id in trained}
                                           for m in raw_groups if m.offset >= int(consumed.get(str(m.partition), 0))],  # JSON keys
        "hashes": hashes,
        # where each task that was not trained got to: the first thing to read when a run misses its deadline
        "untrained": [{"task": t, "groups_on_topic": len(by_task.get(t, ())),
                       "sessions_with_calls": len({c.session_id for c in recorded if c.task_id == t}),
                       "calls": sum(1 for c in recorded if c.task_id == t),
                       "ledger_failures": sum(1 for e in ledger if "failed" in e and e["session"].startswith(f"{t}."))}
                      for t in pipe.tasks if trained_by_task[t] == 0],
    }


def recovery(kills: list[Kill]) -> dict:
    by = collections.defaultdict(list)
    for k in kills:
        if k.recover_s is not None:
            by[k.kind].append(k.recover_s)
    return {kind: {"kills": len(v), "min": min(v), "median": round(statistics.median(v), 2), "max": max(v)}
            for kind, v in sorted(by.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="5 kills (one per kind), one broker: about 3 minutes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kills", type=int, default=0, help="kills in the chaos run (default 5 quick, 30 full)")
    ap.add_argument("--brokers", type=int, default=0, help="1 or 3 (default 1 quick, 3 full)")
    ap.add_argument("--keep", type=Path, help="run in this (new) folder and keep every component's log there")
    args = ap.parse_args()
    kills = args.kills or (5 if args.quick else 30)
    brokers = args.brokers or (1 if args.quick else 3)
    gap = (2.0, 4.0) if args.quick else (4.0, 9.0)
    rng = random.Random(args.seed)
    from infra.models import ensure_model

    model_dir = ensure_model("tiny")
    t_start = time.monotonic()
    if args.keep:
        args.keep.mkdir(parents=True)
    with contextlib.nullcontext(str(args.keep)) if args.keep else tempfile.TemporaryDirectory(prefix="polar-chaos-") as tmp:
        infra = Infra(Path(tmp), brokers, model_dir)
        try:
            say(f"infra up ({brokers} broker{'s' * (brokers > 1)}, s3, engine) in {time.monotonic() - t_start:.0f} s")
            chaotic = Pipeline(infra, "chaos", model_dir, sync=True)
            chaotic.start()
            say("chaos pipeline up")
            try:
                chaos, chaos_s = chaos_run(chaotic, infra, rng, kills, gap, submit_every=3.0 if args.quick else 6.0,
                                           min_tasks=3 if args.quick else 12, deadline_s=300 if args.quick else 1800)
                time.sleep(2)  # late duplicates, if any, land before the audit reads
                got = audit(chaotic)
                got["sync"] = {**chaotic.sync_audit(),
                               "mid_transfer": any(k.at_moment for k in chaos.kills if k.kind == "trainer")}
            finally:
                chaotic.stop()
            say(f"chaos run: {len(chaos.kills)} kills, {got['tasks']} tasks in {chaos_s:.0f} s; reference run next")
            ref = Pipeline(infra, "reference", model_dir)
            ref.start()
            try:
                ref_s = quiet_run(ref, chaotic.tasks, deadline_s=120 if args.quick else 600)
                want = audit(ref)
                say(f"reference run: {want['tasks']} tasks in {ref_s:.0f} s")
            finally:
                ref.stop()
        finally:
            infra.stop()
    hashes_equal = bool(want["hashes"]) and got["hashes"] == want["hashes"]
    differing = sorted(t for t in set(got["hashes"]) | set(want["hashes"]) if got["hashes"].get(t) != want["hashes"].get(t))
    for run in (got, want):
        run.pop("hashes")
    out = {
        "bench": "chaos", "quick": args.quick, "seed": args.seed, "brokers": brokers, "cpus": os.cpu_count(),
        "kills": len(chaos.kills),
        "acked_calls_lost": got["acked_calls_lost"],
        "groups_trained_twice": got["groups_trained_twice"],
        "groups_skipped": got["groups_skipped"],
        "untrained": got["untrained"],
        "hashes_equal": hashes_equal,
        "tasks": got["tasks"], "tasks_hash_differs": differing,
        "kills_by_component": dict(collections.Counter(k.kind for k in chaos.kills)),
        "restarts_unplanned": dict(chaos.restarts),
        "recovery_s": recovery(chaos.kills),
        "masked_samples": got["masked_samples"],
        "trained_sessions_with_holes": got["trained_sessions_with_holes"],
        "sync": got["sync"],
        "runs": {"chaos": {**got, "wall_s": round(chaos_s, 1)}, "reference": {**want, "wall_s": round(ref_s, 1)}},
        "kill_log": [k.__dict__ for k in chaos.kills],
        "wall_s": round(time.monotonic() - t_start, 1),
        "load_avg_1m": os.getloadavg()[0],
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
