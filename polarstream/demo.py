"""The main job: train an agent end to end on this machine through the real system.

Kafka, the S3 server, the engine, a gateway node with its sandboxed harness runs, the Faust stream
worker, the trainer and the rollout server all run as their own processes, exactly as a user would run
them; this module only starts them, submits tasks step by step, watches the topics and writes a report.
Each step is on-policy: the next step's tasks are submitted once the trainer has pushed the weights
trained on the previous step's groups.
"""

from __future__ import annotations

import json
import random
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from infra.settings import Settings
from schemas import HarnessSpec, PolicyVersion, TrainingGroup

from . import demo_tasks
from .processes import Processes, ProcessFailed, free_port


@dataclass
class DemoConfig:
    steps: int = 24
    tasks_per_step: int = 4
    samples: int = 8
    suite_size: int = 4
    harness: str = "builtin"
    runtime: str = "auto"  # bwrap when it works here, else subprocess
    seed: int = 0
    lr: float = 8e-4
    temperature: float = 1.0
    sft_steps: int = 80
    p_tool: float = 0.3
    step_timeout_s: float = 300.0
    run_dir: Path = field(default_factory=lambda: Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S"))


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

    @property
    def merge_rate(self) -> float:
        return 1.0 - self.traces / self.calls if self.calls else 0.0


def demo_model(cfg: DemoConfig, settings: Settings, problems: list[tuple[str, str]]) -> Path:
    """The tiny model after its warm start, cached by everything that determines it."""
    from engine.models import ensure_model
    from gateway.harnesses.builtin import SYSTEM, TOOLS

    from .warmstart import warm_start

    key = json.dumps(["tool-or-prose-v1", cfg.seed, cfg.sft_steps, cfg.p_tool, problems, SYSTEM, TOOLS], sort_keys=True)
    out = settings.cache_dir / "models" / f"demo-sft-{uuid.uuid5(uuid.NAMESPACE_OID, key).hex[:12]}"
    if (out / "config.json").exists():
        return out
    base = ensure_model("tiny" if cfg.seed == 0 else f"tiny:{cfg.seed}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    warm_start(base, tmp, problems, system=SYSTEM, tools=TOOLS, steps=cfg.sft_steps, p_tool=cfg.p_tool, seed=cfg.seed)
    tmp.rename(out)
    return out


def pick_runtime(requested: str) -> str:
    if requested != "auto":
        return requested
    return "bwrap" if shutil.which("bwrap") else "subprocess"


class Watcher:
    """Reads polar.groups and polar.policy as the demo's own consumer (deduplicated by event_id)."""

    def __init__(self, settings: Settings):
        from producers.consumer import Deduper, RecordConsumer

        self.consumer = RecordConsumer(settings, topics=["groups", "policy"], group_id=f"polar-demo-{uuid.uuid4().hex[:8]}")
        self.dedupe = Deduper()
        self.groups: dict[str, TrainingGroup] = {}
        self.policy: PolicyVersion | None = None

    def poll(self, timeout: float = 0.5) -> None:
        for item in self.consumer.poll(timeout):
            rec = item.record
            if self.dedupe.seen(rec.event_id):
                continue
            if isinstance(rec, TrainingGroup):
                self.groups[rec.group_id] = rec
            elif isinstance(rec, PolicyVersion) and (self.policy is None or rec.version >= self.policy.version):
                self.policy = rec

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


def _step_result(step: int, groups: list[TrainingGroup], wall_s: float, version: int) -> StepResult:
    trajs = [t for g in groups for t in g.trajectories]
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
    )


def _view(cfg: DemoConfig, results: list[StepResult], lag: dict[str, int], status: str):
    from rich.table import Table

    t = Table(title=f"polarstream demo - {status}", expand=False)
    for col in ("step", "reward", "samples", "tokens/s", "merge rate", "policy"):
        t.add_column(col, justify="right")
    for r in results[-12:]:
        t.add_row(str(r.step), f"{r.reward:.2f}", str(r.samples), f"{r.sampled_tokens / max(r.wall_s, 1e-9):.0f}",
                  f"{r.merge_rate:.0%}", str(r.policy_version))
    t.caption = "consumer lag: " + (", ".join(f"{k}={v}" for k, v in sorted(lag.items())) or "-")
    return t


def run(cfg: DemoConfig, settings: Settings | None = None) -> Path:
    """Run the demo; returns the path of demo-summary.json."""
    from rich.console import Console
    from rich.live import Live

    from infra.stack import Stack

    from .report import write_report

    console = Console()
    run_dir = cfg.run_dir.absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    # Unique per run, so topics and checkpoints of earlier runs on the same cluster never mix in.
    run_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    base = settings or Settings()
    settings = base.model_copy(update={
        "topic_prefix": base.topic_prefix or f"{run_id}.",
        "storage_url": base.storage_url or f"s3://{base.s3_bucket}/{run_id}",
    })
    t0 = time.monotonic()
    console.print(f"[bold]polarstream demo[/] -> {run_dir}")
    with console.status("bringing up Kafka and the S3 server (first run fetches jars from Maven Central)"):
        Stack(settings).up()
    problems = demo_tasks.suite(cfg.suite_size, cfg.seed)
    model_dir = demo_model(cfg, settings, problems)
    env = {
        "POLAR_KAFKA_BOOTSTRAP": settings.kafka_bootstrap, "POLAR_TOPIC_PREFIX": settings.topic_prefix,
        "POLAR_STORAGE_URL": settings.storage_url, "POLAR_S3_PORT": str(settings.s3_port),
        "POLAR_S3_ENDPOINT": settings.s3_endpoint_url, "POLAR_DATA_DIR": str(run_dir / "data"),
        "POLAR_SESSION_SECRET": settings.session_secret, "POLAR_ADMIN_TOKEN": settings.admin_token,
        "OMP_NUM_THREADS": "1",
    }
    procs = Processes(run_dir / "logs", env)
    watcher: Watcher | None = None
    results: list[StepResult] = []
    ports = {name: free_port() for name in ("engine", "gateway", "rollout")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    runtime = pick_runtime(cfg.runtime)
    try:
        with console.status("starting engine, gateway node, stream worker, trainer and rollout server"):
            engine = procs.start("engine", "engine", "--model", str(model_dir), "--port", str(ports["engine"]),
                                 "--seed", str(cfg.seed), "--threads", "1")
            procs.wait_http(engine, f"{urls['engine']}/health")
            node = procs.start("node", "node", "--engine-url", urls["engine"], "--model", str(model_dir),
                               "--runtime", runtime, "--port", str(ports["gateway"]), "--run-workers", "4",
                               "--init-workers", "4", "--ready-target", "4", "--postrun-workers", "4")
            procs.wait_http(node, f"{urls['gateway']}/health")
            procs.start("streams", "streams", "worker", "--builder", "prefix_merging", "--group-deadline", "120",
                        "--missing-calls-grace", "10")
            procs.start("trainer", "train", "--model", str(model_dir), "--groups-per-step", str(cfg.tasks_per_step),
                        "--max-steps", str(cfg.steps), "--lr", str(cfg.lr), "--engine", f"polar={urls['engine']}",
                        "--gateway", urls["gateway"], "--run-dir", str(run_dir / "trainer"),
                        "--storage-url", settings.storage_url,
                        # a group where every sample scored the same has zero advantages: it still closes the
                        # demo's on-policy step (and costs nothing to train on), so it is not skipped
                        "--set", "skip_zero_variance=false", "--set", "weight_decay=0.0")
            rollout = procs.start("rollout", "rollout", "--port", str(ports["rollout"]))
            procs.wait_http(rollout, f"{urls['rollout']}/health")
        watcher = Watcher(settings)
        harness = HarnessSpec(name=cfg.harness, config={"temperature": cfg.temperature, "max_tokens": 48, "max_turns": 3})
        order = random.Random(cfg.seed)
        lag: dict[str, int] = {}
        with Live(_view(cfg, results, lag, "starting"), console=console, refresh_per_second=2) as live:
            for step in range(cfg.steps):
                started = time.monotonic()
                batch = [order.choice(problems) for _ in range(cfg.tasks_per_step)]
                tasks = [demo_tasks.task_request(q, a, task_id=f"{run_id}-s{step:03d}-t{i}", num_samples=cfg.samples,
                                                 harness=harness).model_dump(mode="json") for i, (q, a) in enumerate(batch)]
                r = httpx.post(f"{urls['rollout']}/tasks", json=tasks, timeout=60)
                r.raise_for_status()
                wanted = {t["group_id"] for t in tasks}
                deadline = started + cfg.step_timeout_s
                while True:  # the step ends when its groups are in and the trainer pushed weights from them
                    watcher.poll()
                    procs.check_all()
                    have = wanted <= watcher.groups.keys()
                    if have and watcher.policy is not None and watcher.policy.version >= step + 1:
                        break
                    if time.monotonic() > deadline:
                        raise ProcessFailed(f"step {step} did not finish within {cfg.step_timeout_s:.0f}s "
                                            f"(groups {len(wanted & watcher.groups.keys())}/{len(wanted)}, "
                                            f"policy {watcher.policy.version if watcher.policy else None}); logs in {procs.log_dir}")
                    live.update(_view(cfg, results, lag, f"step {step + 1}/{cfg.steps}: "
                                                         f"{len(wanted & watcher.groups.keys())}/{len(wanted)} groups"))
                results.append(_step_result(step, [watcher.groups[g] for g in sorted(wanted)], time.monotonic() - started,
                                            watcher.policy.version))
                lag = consumer_lag(settings)
                live.update(_view(cfg, results, lag, f"step {step + 1}/{cfg.steps} done"))
        summary = write_report(run_dir, cfg, results, watcher.policy, settings, time.monotonic() - t0, model_dir)
    finally:
        if watcher is not None:
            watcher.close()
        procs.stop_all()
    return summary
