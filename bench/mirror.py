"""MirrorMaker 2 on loopback: mirrored events/s and region -> center latency (p50/p99) for polar.calls.

Starts two single-node Kafka clusters (a region and the center) and the MirrorMaker 2 process that
`polarstream infra mirror` runs, all on free ports in a temp dir (stopped at the end), then:

- throughput: a burst of events is produced into the region's polar.calls as fast as the producer can
  go (it outruns the mirror, so a backlog builds); events/s is the count over the time from the first
  to the last event arriving at the center;
- latency: events paced at a fixed rate, each stamped with its send time; latency is the time from
  the region producer's send to a consumer at the center receiving it (one machine, one clock).

Prints one JSON object.

    .venv/bin/python bench/mirror.py [--quick]
"""

from __future__ import annotations

MEASURES = ('infra/',)  # the code these figures describe (bench/_provenance.py)

import argparse
import json
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra.clusters import Cluster  # noqa: E402
from infra.maven import fetch, pom_property  # noqa: E402
from infra.mirror import MirrorMaker, mirror_properties  # noqa: E402
from infra.settings import Settings  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def _producer(settings: Settings):
    from confluent_kafka import Producer

    # As the gateway's publisher: acks=all, idempotent, zstd level 1; a 1 ms linger keeps paced sends prompt.
    return Producer(settings.kafka_config(**{"acks": "all", "enable.idempotence": True,
                                             "compression.type": "zstd", "compression.level": 1, "linger.ms": 1}))


def _consumer(settings: Settings, topic: str):
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer(settings.kafka_config(**{"group.id": f"bench-{time.monotonic_ns()}", "enable.auto.commit": False,
                                          "fetch.wait.max.ms": 10}))
    parts = c.list_topics(topic, timeout=10).topics[topic].partitions
    # From the current end, resolved now: OFFSET_END resolves at the first fetch and could skip events.
    c.assign([TopicPartition(topic, p, c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]) for p in parts])
    return c


def _payload(size: int, stamp: float) -> bytes:
    # The send time first; the rest random so compression cannot shrink the event to nothing.
    return struct.pack("<d", stamp) + os.urandom(size - 8)


def _drain(consumer, n: int, timeout: float) -> list[tuple[float, float]]:
    """(receive time, send time) of the next ``n`` events at the center."""
    got: list[tuple[float, float]] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        for m in consumer.consume(1000, max(0.0, min(0.1, deadline - time.monotonic()))):
            if not m.error():
                got.append((time.time(), struct.unpack("<d", m.value()[:8])[0]))
    return got


def throughput(region: Settings, center: Settings, n: int, size: int) -> dict:
    """Burst ``n`` events into the region; events/s mirrored, first to last arrival at the center."""
    topic = region.topic("calls")
    consumer = _consumer(center, topic)
    producer = _producer(region)
    try:
        for i in range(n):
            while True:
                try:
                    producer.produce(topic, key=f"s{i % 64}".encode(), value=_payload(size, time.time()))
                    break
                except BufferError:
                    producer.poll(0.05)
        producer.flush(60)
        got = _drain(consumer, n, timeout=180)
    finally:
        consumer.close()
    if len(got) < n:
        raise SystemExit(f"only {len(got)} of {n} events reached the center")
    span = got[-1][0] - got[0][0]
    return {"events": n, "event_bytes": size, "events_per_s": round(n / max(span, 1e-6), 1),
            "mb_per_s": round(n * size / max(span, 1e-6) / 1e6, 2)}


def latency(region: Settings, center: Settings, n: int, rate: float, size: int) -> dict:
    """``n`` events at ``rate``/s; send -> receive-at-center latency percentiles in ms."""
    topic = region.topic("calls")
    consumer = _consumer(center, topic)
    producer = _producer(region)
    got: list[tuple[float, float]] = []
    try:
        start = time.monotonic()
        for i in range(n):
            # Receive while sending (not in a pass afterwards), so every receive time is prompt.
            while time.monotonic() < start + i / rate:
                got += _drain(consumer, 1, timeout=0.005)
            producer.produce(topic, key=f"s{i % 64}".encode(), value=_payload(size, time.time()))
            producer.poll(0)
        producer.flush(30)
        got += _drain(consumer, n - len(got), timeout=60)
    finally:
        consumer.close()
    ms = [(recv - sent) * 1000 for recv, sent in got]
    if len(ms) < n:
        raise SystemExit(f"only {len(ms)} of {n} paced events reached the center")
    return {"events": len(ms), "rate_per_s": rate, "event_bytes": size,
            "p50_ms": percentile(ms, 0.5), "p99_ms": percentile(ms, 0.99), "max_ms": round(max(ms), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer events: finishes in under a minute")
    args = parser.parse_args()
    n_burst, n_paced, rate, size = (5_000, 300, 100.0, 1024) if args.quick else (50_000, 2_000, 200.0, 1024)
    with tempfile.TemporaryDirectory(prefix="polar-bench-mirror-") as tmp:
        base = Settings(data_dir=Path(tmp), topic_prefix="bench.")
        for profile in ("kafka", "mirror"):
            fetch(profile, base)
        clusters = {n: Cluster(base, n, create=True, ephemeral=True, heap_mb=256 if args.quick else 512)
                    for n in ("region", "center")}
        mm = None
        try:
            for c in clusters.values():
                c.kafka.launch()
            for c in clusters.values():
                c.up()
            region, center = clusters["region"].settings, clusters["center"].settings
            props = mirror_properties("region", region.kafka_bootstrap, "center", center.kafka_bootstrap, base, refresh_s=2)
            mm = MirrorMaker(base, region="region", center="center", props=props, die_with_parent=True, quick_jit=args.quick)
            started = time.perf_counter()
            mm.start(180)
            warm = latency(region, center, 50, 50.0, size)  # waits until the flow is live end to end
            startup_s = time.perf_counter() - started
            results = {"throughput": throughput(region, center, n_burst, size),
                       "latency": latency(region, center, n_paced, rate, size)}
        finally:
            if mm is not None:
                mm.stop()
            for c in clusters.values():
                c.down()
    print(json.dumps({
        "bench": "mirror", "quick": args.quick, "kafka": pom_property("kafka.version"),
        "mirrormaker": pom_property("mirror.version"), "topic": "polar.calls", "partitions": 4,
        "broker_jit": "c1", "mirror_jit": "c1" if args.quick else "tiered", "mirror_live_after_s": round(startup_s, 2),
        "warmup_events": warm["events"], "cpus": os.cpu_count(), "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()
