"""Broker loss on the replicated local cluster: what a harness call feels when one Kafka broker dies.

Starts its own 3-broker cluster (`infra up --brokers 3`'s layout: RF 3, min.insync.replicas 2) on free
ports in a temp dir, publishes 4 KB CallRecorded events through the durable Publisher (acks=all, as the
gateway does) at a steady offered load, open loop (a publish starts on its schedule whether or not the
previous ones were acknowledged, and its latency counts from that scheduled moment, so a stall is
never hidden), and meanwhile SIGKILLs one broker, then starts it again:

- quick: a broker that leads ``calls`` partitions but is not the active KRaft controller;
- full: that, then the active controller (controller failover comes before the leader election).

For each kill it reports publish-to-acknowledgement latency p50/p99/max by phase of the scheduled send
time: ``before`` the kill (after a 3 s warm-up), ``during`` (from 0.5 s before the kill, sends still in
flight then, until every ``calls`` partition has a leader other than the dead broker), ``degraded`` (new
leaders, broker still down), ``rejoining`` (restart until back in every ISR) and ``after``; the
leader-election time (kill until new leaders, polled every 50 ms); the p99 and the max latency added over
the typical (p50 ``before``) latency; the longest any call was still waiting after the kill, and by how
much that exceeds the election. At the end every acknowledged event is read back: ``acked_events_lost``
and ``duplicates`` (``publish_failures``: sends that were never acknowledged).

    .venv/bin/python bench/broker_loss.py [--quick] [--rate EVENTS_PER_S] [--client KEY=VALUE ...]
"""

from __future__ import annotations

MEASURES = ('producers/', 'schemas/', 'infra/')  # the code these figures describe (bench/_provenance.py)

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra.kafka_cluster import KafkaCluster  # noqa: E402
from infra.maven import fetch, pom_property  # noqa: E402
from infra.process import free_port  # noqa: E402
from infra.settings import Settings  # noqa: E402
from infra.topics import ensure_topics  # noqa: E402
from producers.consumer import RecordConsumer  # noqa: E402
from producers.publisher import Publisher, PublishError  # noqa: E402
from schemas import CallRecorded, encode  # noqa: E402

SIZE = 4096
WARMUP_S = 3.0  # the first seconds of load are not the baseline: the JVMs' JIT is still warming up
IN_FLIGHT_S = 0.5  # a send this close before the kill may be waiting on the dying leader: it counts as during


def make_call(rng: random.Random, index: int) -> CallRecorded:
    """A CallRecorded of about SIZE encoded bytes (random ids: compression cannot shrink it)."""
    base = CallRecorded(session_id=f"bench-{index % 64}", call_index=index, provider="engine", prompt_ids=[])
    # packed (the default record format): 4 bytes an id, after the container's header
    ids_needed = max(0, (SIZE - len(encode(base.model_copy(update={"prompt_ids": [1]}), packed=True))) // 4)
    return base.model_copy(update={"prompt_ids": [rng.randrange(10_000, 150_000) for _ in range(ids_needed)]})


def summary(latencies: list[float]) -> dict:
    if not latencies:
        return {"events": 0}
    xs = sorted(latencies)
    pick = lambda q: round(xs[min(len(xs) - 1, int(q * len(xs)))], 1)  # noqa: E731
    return {"events": len(xs), "p50_ms": pick(0.5), "p99_ms": pick(0.99), "max_ms": round(xs[-1], 1)}


def controller_index(cluster: KafkaCluster) -> int | None:
    """The index of the active KRaft controller, from a live node's quorum-state file (None if unknown)."""
    for node, up in zip(cluster.nodes, cluster.running()):
        if not up:
            continue
        try:
            leader = json.loads((node.log_dir / "__cluster_metadata-0" / "quorum-state").read_text()).get("leaderId", -1)
        except (OSError, ValueError):
            continue
        if leader is not None and leader >= 0:
            return cluster.index_of(int(leader))
    return None


def pick_victim(cluster: KafkaCluster, settings: Settings, target: str) -> tuple[int | None, int | None]:
    """(index of the broker to kill, index of the active controller) for ``target``: "partition leader"
    is a broker leading some ``calls`` partition that is not the controller (a plain broker loss) when
    there is one; "controller" is the active controller (controller failover plus leader election)."""
    controller = controller_index(cluster)
    if target == "controller":
        return controller, controller
    watch = Watch(settings, settings.topic("calls"))
    leaders = sorted({cluster.index_of(m.leader) for m in watch.partitions().values() if m.leader >= 0})
    plain = [i for i in leaders if i != controller]
    return (plain or leaders or [None])[0], controller


class Watch:
    """Partition leaders and ISRs of one topic, polled through an admin client."""

    def __init__(self, settings: Settings, topic: str):
        from confluent_kafka.admin import AdminClient

        self.topic = topic
        self.admin = AdminClient(settings.kafka_config(log_level=0))

    def partitions(self) -> dict:
        meta = self.admin.list_topics(self.topic, timeout=5).topics.get(self.topic)
        return dict(meta.partitions) if meta is not None else {}

    def led_by(self, node_id: int) -> list[int]:
        return sorted(p for p, m in self.partitions().items() if m.leader == node_id)

    def wait_new_leaders(self, node_id: int, timeout: float = 60.0) -> float:
        """Seconds until no partition is led by ``node_id`` and each has a leader (polled every 50 ms)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            try:
                parts = self.partitions()
                if parts and all(m.leader >= 0 and m.leader != node_id for m in parts.values()):
                    return time.monotonic() - start
            except Exception:  # noqa: BLE001 - metadata from a broker that is going away: ask again
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.topic}: no new leaders {timeout:.0f} s after node {node_id} was killed")

    def wait_full_isr(self, replicas: int, timeout: float = 120.0) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            try:
                parts = self.partitions()
                if parts and all(len(m.isrs) >= replicas for m in parts.values()):
                    return time.monotonic() - start
            except Exception:  # noqa: BLE001
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.topic}: ISRs not back to {replicas} within {timeout:.0f} s")


async def scenario(cluster: KafkaCluster, settings: Settings, rate: float, targets: list[str], phase_s: dict,
                   client: dict | None = None) -> dict:
    """Open-loop publishing at ``rate`` events/s while each target broker is killed and restarted."""
    rng = random.Random(0)
    pool = [make_call(rng, i) for i in range(512)]
    watch = Watch(settings, settings.topic("calls"))
    sent: list[tuple[float, float | None, str]] = []  # (scheduled at, acked at or None, event id)
    failures: list[str] = []
    marks: list[dict] = []
    stop = asyncio.Event()
    pending: set[asyncio.Task] = set()

    async with Publisher(settings, config=client) as pub:
        for ev in pool[:50]:  # connections, producer id, metadata: paid before the clock starts
            await pub.publish(ev.model_copy(update={"event_id": f"warm-{ev.event_id}"}))

        async def one(i: int, at: float) -> None:
            ev = pool[i % len(pool)].model_copy(update={"event_id": f"{i:08d}", "call_index": i})
            try:
                await pub.publish(ev)
                sent.append((at, time.monotonic(), ev.event_id))
            except PublishError as e:
                failures.append(str(e))
                sent.append((at, None, ev.event_id))

        load_started: list[float] = []

        async def load() -> None:
            t0, i = time.monotonic(), 0
            load_started.append(t0)
            while not stop.is_set():
                at = t0 + i / rate
                delay = at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(one(i, at))
                pending.add(task)
                task.add_done_callback(pending.discard)
                i += 1

        loader = asyncio.create_task(load())
        for target in targets:
            await asyncio.sleep(phase_s["before"])
            victim, controller = await asyncio.to_thread(pick_victim, cluster, settings, target)
            if victim is None:
                continue
            node_id = cluster.nodes[victim].member.node_id
            mark = {"target": target, "broker": victim, "node_id": node_id, "was_controller": victim == controller,
                    "partitions_led": await asyncio.to_thread(watch.led_by, node_id)}
            mark["killed_at"] = time.monotonic()
            await asyncio.to_thread(cluster.kill, victim)
            election = await asyncio.to_thread(watch.wait_new_leaders, node_id)
            mark["elected_at"] = mark["killed_at"] + election
            await asyncio.sleep(phase_s["degraded"])
            mark["restart_at"] = time.monotonic()
            # Spawned from the main thread so that the JVM dies with this process (run_all's timeout
            # kills our process group, not the JVM's own session); the wait runs beside the load.
            cluster.nodes[victim].launch()
            await asyncio.to_thread(cluster.nodes[victim].wait_ready, 120)
            mark["serving_at"] = time.monotonic()
            await asyncio.to_thread(watch.wait_full_isr, cluster.brokers)
            mark["rejoined_at"] = time.monotonic()
            marks.append(mark)
        await asyncio.sleep(phase_s["after"])
        stop.set()
        await loader
        if pending:
            await asyncio.gather(*pending)

    kills = []
    for k, mark in enumerate(marks):
        # The first seconds of load warm the JVMs up; a send up to IN_FLIGHT_S before the kill may still be
        # waiting on the dying leader, so it counts as "during".
        start = marks[k - 1]["rejoined_at"] if k else load_started[0] + WARMUP_S
        end = marks[k + 1]["killed_at"] - IN_FLIGHT_S if k + 1 < len(marks) else float("inf")
        hit = mark["killed_at"] - IN_FLIGHT_S
        bounds = {"before": (start, hit), "during": (hit, mark["elected_at"]),
                  "degraded": (mark["elected_at"], mark["restart_at"]),
                  "rejoining": (mark["restart_at"], mark["rejoined_at"]), "after": (mark["rejoined_at"], end)}
        lat = {name: [(ack - at) * 1000 for at, ack, _ in sent if ack is not None and lo <= at < hi]
               for name, (lo, hi) in bounds.items()}
        phases = {name: summary(xs) for name, xs in lat.items()}
        typical = phases["before"].get("p50_ms", 0.0)
        affected = lat["during"] + lat["degraded"] + lat["rejoining"]
        worst = max(affected, default=0.0)
        # How long after the kill a call was still waiting (a send before the kill counts from the kill).
        stuck = max(((ack - max(at, mark["killed_at"])) * 1000 for at, ack, _ in sent
                     if ack is not None and bounds["during"][0] <= at < bounds["rejoining"][1]), default=0.0)
        election_ms = (mark["elected_at"] - mark["killed_at"]) * 1000
        kills.append({
            "target": mark["target"], "broker_index": mark["broker"], "node_id": mark["node_id"],
            "was_controller": mark["was_controller"], "partitions_led": mark["partitions_led"],
            "leader_election_ms": round(election_ms, 1),
            # Added = over the typical (p50) latency before the kill.
            "p99_added_ms_during_kill": round(phases["during"].get("p99_ms", typical) - typical, 1),
            "max_added_ms": round(worst - typical, 1),
            "max_wait_after_kill_ms": round(stuck, 1),
            "max_wait_over_election_ms": round(stuck - election_ms, 1),
            "restart_to_serving_s": round(mark["serving_at"] - mark["restart_at"], 2),
            "restart_to_full_isr_s": round(mark["rejoined_at"] - mark["restart_at"], 2),
            "phases": phases,
        })
    acked = [eid for _, ack, eid in sent if ack is not None]
    return {"kills": kills, "published": len(sent), "acked": len(acked), "publish_failures": len(failures),
            "failure_examples": failures[:3], "acked_ids": acked}


def read_back(settings: Settings, want: set[str], timeout: float = 60.0) -> tuple[int, int]:
    """(acknowledged events not found, events found more than once) on the calls topic."""
    seen: dict[str, int] = {}
    consumer = RecordConsumer(settings, ["calls"])
    try:
        deadline = time.monotonic() + timeout
        idle = 0
        while time.monotonic() < deadline and idle < 3:
            batch = consumer.poll(1.0, max_records=5000)
            idle = 0 if batch else idle + (1 if want <= seen.keys() else 0)
            for item in batch:
                seen[item.record.event_id] = seen.get(item.record.event_id, 0) + 1
    finally:
        consumer.close()
    return len(want - seen.keys()), sum(1 for eid, n in seen.items() if n > 1 and not eid.startswith("warm-"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one kill (a partition leader): about a minute")
    parser.add_argument("--rate", type=float, default=100.0, help="offered load, events/s (default 100)")
    parser.add_argument("--client", action="append", default=[], metavar="KEY=VALUE",
                        help="a librdkafka setting for the publisher on top of producers/publisher.py's (repeatable)")
    args = parser.parse_args()
    client = dict(kv.split("=", 1) for kv in args.client)
    targets = ["partition leader"] if args.quick else ["partition leader", "controller"]
    phase_s = {"before": 6.0, "degraded": 3.0, "after": 3.0} if args.quick else {"before": 8.0, "degraded": 5.0, "after": 5.0}
    with tempfile.TemporaryDirectory(prefix="polar-bench-") as tmp:
        base = Settings(data_dir=Path(tmp), kafka_port=free_port(), kafka_controller_port=free_port(), topic_prefix="bench.")
        fetch("kafka", base)
        # C1-only JIT in both modes: three JVMs on two cores start in ~10 s instead of ~30 (as the tests do).
        cluster = KafkaCluster(base, 3, heap_mb=256, die_with_parent=True, quick_jit=True)
        started = time.perf_counter()
        try:
            cluster.start(180)
            startup_s = time.perf_counter() - started
            settings = Settings(data_dir=Path(tmp), topic_prefix="bench.")  # every broker, as components see it
            ensure_topics(settings)
            result = asyncio.run(scenario(cluster, settings, args.rate, targets, phase_s, client))
            lost, dups = read_back(settings, set(result.pop("acked_ids")))
        finally:
            cluster.stop(force=True)
    kills = result["kills"]
    out = {
        "bench": "broker_loss", "quick": args.quick, "kafka": pom_property("kafka.version"), "brokers": 3,
        "replication_factor": 3, "min_insync_replicas": 2, "acks": "all", "event_bytes": SIZE,
        "offered_load_events_per_s": args.rate, "broker_startup_s": round(startup_s, 2), "cpus": os.cpu_count(),
        "broker_session_timeout_ms": 3000, "publisher_overrides": client, **result,
        "acked_events_lost": lost, "duplicates": dups,
        "comparisons": [{"area": "Broker loss (3 brokers)", "metric": f"p99 added latency, {k['target']} killed",
                         "ours": k["p99_added_ms_during_kill"], "anchor": k["leader_election_ms"],
                         "anchor_name": "leader election", "unit": "ms", "higher_is_better": False,
                         "note": f"longest wait after the kill {k['max_wait_after_kill_ms']} ms; "
                                 f"{lost} acknowledged events lost"} for k in kills],
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
