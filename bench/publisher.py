"""Durable publishing speed: events/s and delivery latency at acks=all, for 4 KB and 64 KB calls.

Starts its own single-node Kafka broker on free ports in a temp dir (stopped at the end), publishes
CallRecorded events whose token ids make them the target size on the wire, and prints one JSON object:

- pipelined: 64 publishes in flight at any time (a busy gateway); events/s, MB/s and each event's
  publish-to-acknowledgement latency under that load;
- sequential: one publish awaited at a time (one harness waiting on its call); latency only.

    .venv/bin/python bench/publisher.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra.kafka import KafkaBroker  # noqa: E402
from infra.maven import pom_property  # noqa: E402
from infra.process import free_port  # noqa: E402
from infra.settings import Settings  # noqa: E402
from infra.topics import ensure_topics  # noqa: E402
from producers.publisher import Publisher  # noqa: E402
from schemas import CallRecorded, encode  # noqa: E402

SIZES = (4096, 65536)
CONCURRENCY = 64  # calls in flight at once, e.g. 64 harnesses waiting on their model calls


def make_call(size: int, rng: random.Random, index: int) -> CallRecorded:
    """A CallRecorded of about ``size`` encoded bytes; random token ids, so compression cannot cheat."""
    base = CallRecorded(session_id=f"bench-{index % 64}", call_index=index, provider="engine", prompt_ids=[])
    ids_needed = max(0, (size - len(encode(base))) // 7)  # a 5-6 digit id plus a comma is ~7 bytes
    return base.model_copy(update={"prompt_ids": [rng.randrange(10_000, 150_000) for _ in range(ids_needed)]})


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


async def pipelined(settings: Settings, events: list[CallRecorded], concurrency: int = CONCURRENCY) -> dict:
    """``concurrency`` publishers awaiting their own acknowledgements, sharing one Publisher."""
    queue = list(reversed(events))
    latencies: list[float] = []

    async with Publisher(settings) as pub:
        await pub.publish(events[0])  # connection, metadata and producer id: paid once per publisher
        sent_before = pub.stats.bytes

        async def worker() -> None:
            while queue:
                ev = queue.pop()
                start = time.perf_counter()
                await pub.publish(ev)
                latencies.append((time.perf_counter() - start) * 1000)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
        sent_bytes = pub.stats.bytes - sent_before
    return {"events": len(events), "concurrency": concurrency, "seconds": round(elapsed, 3),
            "events_per_s": round(len(events) / elapsed, 1), "mb_per_s": round(sent_bytes / elapsed / 1e6, 2),
            "latency_p50_ms": percentile(latencies, 0.5), "latency_p99_ms": percentile(latencies, 0.99)}


async def sequential(settings: Settings, events: list[CallRecorded]) -> dict:
    async with Publisher(settings, linger_ms=0) as pub:
        await pub.publish(events[0])  # not measured: the one-time connection setup
        latencies = []
        for ev in events:
            start = time.perf_counter()
            await pub.publish(ev)
            latencies.append((time.perf_counter() - start) * 1000)
    return {"events": len(events), "latency_p50_ms": percentile(latencies, 0.5),
            "latency_p99_ms": percentile(latencies, 0.99), "latency_mean_ms": round(statistics.fmean(latencies), 3)}


async def run(settings: Settings, quick: bool) -> list[dict]:
    rng = random.Random(0)
    counts = {4096: (2_000, 200), 65536: (400, 100)} if quick else {4096: (20_000, 1_000), 65536: (3_000, 500)}
    await pipelined(settings, [make_call(4096, rng, i) for i in range(300)])  # warm up broker JIT and topics
    results = []
    for size in SIZES:
        n_pipe, n_seq = counts[size]
        events = [make_call(size, rng, i) for i in range(n_pipe)]
        wire = statistics.fmean(len(encode(e)) for e in events[:50])
        results.append({"size_bytes": size, "wire_bytes_mean": round(wire),
                        "pipelined": await pipelined(settings, events),
                        "sequential": await sequential(settings, events[:n_seq])})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer events: finishes in well under a minute")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="polar-bench-") as tmp:
        port = free_port()
        settings = Settings(data_dir=Path(tmp), kafka_port=port, kafka_controller_port=free_port(),
                            kafka_bootstrap=f"127.0.0.1:{port}", topic_prefix="bench.")
        # --quick trades the broker's peak JIT for a start twice as fast; the full run measures C2.
        broker = KafkaBroker(settings, die_with_parent=True, quick_jit=args.quick)
        started = time.perf_counter()
        broker.start()
        startup_s = time.perf_counter() - started
        try:
            ensure_topics(settings)
            results = asyncio.run(run(settings, args.quick))
        finally:
            broker.stop()
    print(json.dumps({
        "bench": "publisher", "quick": args.quick, "kafka": pom_property("kafka.version"),
        "acks": "all", "idempotence": True, "compression": "lz4", "partitions": 4,
        "broker_jit": "c1" if args.quick else "tiered", "broker_startup_s": round(startup_s, 2), "cpus": os.cpu_count(), "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()
