"""Stream processors: assembly speed, worker throughput and latency, state size, builder comparison.

Runs on recorded-looking agent sessions (streams/synthetic.py: ChatML turns with tool calls, delta-
encoded prompts like the gateway records them, a side call per session and a compaction in every
fifth). Prints one JSON object:

- assembly: calls/s of the pure fold + builder + verification, per builder (no Kafka), the builders run in
  interleaved rounds (bench/_rounds.py: per_request, prefix_merging, per_request, ...), one thread;
  calls/s is the median over rounds, ``rounds`` the full record (min, spread, CPU/wall, flagged passes);
- state: bytes a session occupies at its peak in the worker's tables (bookkeeping and a reference per
  call), in its cache of recent calls (delta-encoded token data, memory only) and in the fold's memory,
  next to the bytes of its calls on polar.calls;
- builders: on the same sessions, sequences, trainable tokens and trainer-side tokens (what a trainer
  runs forward/backward over) for per_request vs prefix_merging;
- worker: one `polarstream streams worker` process on a real broker (started here unless --bootstrap):
  calls/s end to end for a burst of sessions published at once (three bursts of new sessions, one with
  --quick, a pass each: min, median and max; the headline is the median pass); interleaved with those,
  two bursts (one with --quick) with a second worker process that joins the consumer group before its
  pass and leaves after it (``two_workers``: does scaling out by partitions raise throughput on this
  machine?), and two (one with --quick) with one worker draining a backlog: stopped while the burst is
  published, timed from when it resumes (the load generator then takes no CPU from it); then p50/p99
  latency from a group's
  last finished event to its TrainingGroup on polar.groups (broker timestamps) with groups arriving
  one by one; also the worker's CPU seconds during the burst (it shares the cores with the broker and
  this process). Everything is published through one long-lived Publisher, connected beforehand;
- bytes: Kafka bytes per session (the broker's log segments, as stored: compressed) of every topic a
  pass writes, at three session lengths, over the raw int32 bytes of the session's distinct tokens. These
  sessions take their ids uniformly from a 151k vocabulary (``incompressible_tokenize``), a worst case
  for compression, instead of the 16-word stand-in the other parts use; their logprobs, as in every
  part, are float32 values at the 9 digits the gateway records (streams/synthetic.py). Each length runs
  twice on the same sessions: records packed (the default, docs/events.md), then JSON (``*_json``).

Top level, for issue 21: ``worker_calls_per_s``, ``worker_calls_per_cpu_s``, ``worker_drain_calls_per_s``,
``two_workers_calls_per_s``,
``group_latency_p99_ms``,
``bytes_per_session_over_raw`` (the middle length: 24 turns, 8 with --quick; packed) and
``bytes_per_session_over_raw_json``.

    .venv/bin/python bench/streams.py [--quick] [--bootstrap HOST:PORT]
"""

from __future__ import annotations

MEASURES = ('streams/', 'producers/', 'schemas/')  # the code these figures describe (bench/_provenance.py)

import argparse
import hashlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson  # noqa: E402

from bench._rounds import interleaved, load_avg, proc_cpu_s  # noqa: E402
from infra.process import free_port  # noqa: E402
from infra.settings import Settings  # noqa: E402
from infra.topics import ensure_topics  # noqa: E402
from producers.publisher import Publisher  # noqa: E402
from schemas import encode  # noqa: E402
from streams.assembly import CallTokens, fold_calls, state_bytes  # noqa: E402
from streams.builders import assemble  # noqa: E402
from streams.sessions import add_call, add_finished, new_session  # noqa: E402
from streams.source_log import ref  # noqa: E402
from streams.synthetic import Recorded, SessionSpec, record_session  # noqa: E402
from tests.streams.helpers import WorkerProcess, publish, read_topic, topic_consumer  # noqa: E402

SAMPLES = 4


def sessions(groups: int, turns: int, words: dict, tag: str, seed: int = 0, tokenize=None) -> list[list[Recorded]]:
    """``groups`` groups of SAMPLES sessions each."""
    out = []
    for g in range(groups):
        gid = f"{tag}{g}"
        out.append([
            record_session(SessionSpec(
                f"{gid}-s{i}", gid, i, num_samples=SAMPLES, min_valid=2, reward=float((g + i) % 2), turns=turns,
                side_call_at=1, compaction_at=turns // 2 if (g * SAMPLES + i) % 5 == 0 else None, **words,
            ), seed + g, tokenize)
            for i in range(SAMPLES)
        ])
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


# Pure Python on one core: a pass that got under half a core was starved by other jobs; re-run it.
CPU_FLOOR = 0.5


def bench_assembly(recs: list[Recorded], repeat: int, rounds: int = 3) -> dict:
    calls = [[CallTokens.from_record(c) for c in r.calls] for r in recs]
    n = sum(map(len, calls))

    def build(builder: str):
        def one_pass() -> dict:
            for cs in calls:
                assemble(cs, builder)
            return {"calls": n}
        return one_pass

    res = interleaved({b: build(b) for b in ("per_request", "prefix_merging")}, rounds, cpu_floor=CPU_FLOOR, threads=1,
                      warmup=True, progress=False)
    out: dict = {b: {"calls_per_s": round(n / t["wall_s"]["median"]), "calls_per_s_best": round(n / t["wall_s"]["min"])}
                 for b, t in res["targets"].items()}
    out["rounds"] = res
    start = time.perf_counter()
    for _ in range(repeat):
        for cs in calls:
            fold_calls(cs)
    out["fold_only_calls_per_s"] = round(n * repeat / (time.perf_counter() - start))
    return out


def bench_state(recs: list[Recorded]) -> dict:
    """Bytes a session holds at its peak: in the tables (changelogged: a reference per call, offsets of
    ten digits), in the worker's cache of recent calls (memory only), in the fold."""
    table, cache, fold, wire = [], [], [], []
    for r in recs:
        st = new_session(r.finished.session_id, 0.0, 0)
        stored = cached = 0
        for c in r.calls:
            add_call(st, c.call_index, c.event_id, 0.0)
            stored += len(ref(c.event_id, 0, 10**10 - 1))
            cached += CallTokens.from_record(c).held_bytes()
        add_finished(st, r.finished, 0.0)
        table.append(stored + len(orjson.dumps(st.to_json())))
        cache.append(cached)
        fold.append(state_bytes(fold_calls([CallTokens.from_record(c) for c in r.calls])))
        wire.append(sum(len(encode(c)) for c in r.calls))
    return {"table_bytes_per_session_mean": round(statistics.fmean(table)), "table_bytes_per_session_max": max(table),
            "cache_bytes_per_session_mean": round(statistics.fmean(cache)),
            "fold_bytes_per_session_mean": round(statistics.fmean(fold)),
            "calls_topic_bytes_per_session_mean": round(statistics.fmean(wire))}


def bench_builders(recs: list[Recorded]) -> dict:
    out = {}
    for builder in ("per_request", "prefix_merging"):
        traces = [t for r in recs for t in assemble([CallTokens.from_record(c) for c in r.calls], builder).traces]
        out[builder] = {"sequences": len(traces), "trainable_tokens": sum(sum(t.loss_mask) for t in traces),
                        "trainer_tokens": sum(len(t.token_ids) for t in traces),
                        "longest_sequence": max(len(t.token_ids) for t in traces)}
    pr, pm = out["per_request"], out["prefix_merging"]
    out["per_request_over_prefix_merging"] = {
        "sequences": round(pr["sequences"] / pm["sequences"], 2),
        "trainer_tokens": round(pr["trainer_tokens"] / pm["trainer_tokens"], 2)}
    return out


class GroupsSeen:
    """The groups on polar.groups, read once, as they come: waiting for a pass's groups reads only what
    is new. Reading the topic from its start at every wait (``read_topic``) had the load generator
    decompress every earlier pass's groups again while the worker was being timed."""

    def __init__(self, settings: Settings):
        self.consumer = topic_consumer(settings, settings.topic("groups"))
        self.timestamps: dict[str, int] = {}  # group id -> when its first copy was appended

    def wait(self, total: int, timeout: float) -> None:
        """Until ``total`` distinct groups are in; TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while len(self.timestamps) < total:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.timestamps)} of {total} groups after {timeout:.0f}s")
            m = self.consumer.poll(0.2)
            if m is not None and not m.error():
                self.timestamps.setdefault(m.key().decode(), m.timestamp()[1])

    def close(self) -> None:
        self.consumer.close()


def bench_worker(settings: Settings, bursts: list[list[list[Recorded]]], paced: list[list[Recorded]], log_dir: Path,
                 workers: list[int | str]) -> dict:
    """Burst throughput (one pass per burst: the same shape, new sessions), with ``workers[i]`` worker
    processes in pass i (1 and 2 interleaved: the second joins before its pass and leaves after, and
    the pass starts once the partitions are rebalanced), then finished -> group latency on paced
    groups with one worker.

    A ``"drain"`` pass is one worker draining a backlog: it is stopped (SIGSTOP) while the burst is
    published and timed from when it resumes, so the load generator's publishing does not share the two
    cores with it (the broker still does: it serves the fetches and takes the outputs).

    Every record goes through one Publisher connected during the warm-up, as a gateway keeps its own:
    a fresh idempotent producer spends hundreds of ms connecting and getting its producer id, with
    its records' timestamps already set, and that wait is the load generator's, not the worker's."""
    args = ["--tick-interval", "1", "--stats-interval", "2"]
    worker = WorkerProcess(settings, log_dir / "worker.log", args).start()
    pub = Publisher(settings)

    def send(records: list[Recorded]) -> None:
        for fut in [pub.submit(r) for r in records]:
            fut.result(60)

    passes: dict[int | str, list[dict]] = {1: [], 2: [], "drain": []}
    second = None
    seen = GroupsSeen(settings)
    try:
        warm = sessions(1, 2, {}, "warm", seed=99)[0]  # the worker is up and owns its partitions once this is out
        send([r for s in warm for r in s.records])
        total = 1
        seen.wait(total, timeout=120)

        def settle(n: int, tag: str) -> None:
            """Until ``n`` workers own the partitions and are past recovering their tables: a few small
            groups (spread over the partitions) come out."""
            nonlocal total
            wait_for_members(settings, n)
            few = sessions(8, 2, {}, tag, seed=7)
            send([r for g in few for s in g for r in s.records])
            total += len(few)
            seen.wait(total, timeout=120)

        for i, (burst, n) in enumerate(zip(bursts, workers)):
            if n == 2:
                second = WorkerProcess(settings, log_dir / f"worker2-{i}.log", args).start()
            if i:  # the first pass follows the warm-up: nothing changed since
                settle(2 if n == 2 else 1, f"settle{i}-")
            pids = [worker.proc.pid] + ([second.proc.pid] if second else [])
            n_calls = sum(len(s.calls) for g in burst for s in g)
            load = load_avg()
            records = [r for g in burst for s in g for r in s.records]
            if n == "drain":  # the backlog is in before the clock starts: the worker is stopped meanwhile
                os.kill(worker.proc.pid, signal.SIGSTOP)
                try:
                    send(records)
                finally:
                    os.kill(worker.proc.pid, signal.SIGCONT)
            start, cpu_start = time.perf_counter(), proc_cpu_s(pids)
            if n != "drain":
                send(records)
            total += len(burst)
            seen.wait(total, timeout=600)
            seconds, cpu_s = time.perf_counter() - start, proc_cpu_s(pids) - cpu_start
            passes[n].append({"pass": i, "workers": 2 if n == 2 else 1, "groups": len(burst), "calls": n_calls, "seconds": round(seconds, 2),
                              "calls_per_s": round(n_calls / seconds, 1), "worker_cpu_s": round(cpu_s, 2),
                              "calls_per_worker_cpu_s": round(n_calls / cpu_s, 1), "load_avg_before": load})
            if second is not None:
                second.stop()
                second = None

        if workers[-1] == 2:
            settle(1, "settled-")
        for g in paced:  # groups finish one by one, each session's calls before its finished event
            send([r for s in g for r in s.records])
            time.sleep(0.2)
        total += len(paced)
        seen.wait(total, timeout=300)
        paced_ids = {s.finished.session_id for g in paced for s in g}
        events = read_topic(settings, "session-events", timeout=60,  # until every paced finished event is read
                            until=lambda m: paced_ids <= {x.key.decode() for x in m})
    finally:
        seen.close()
        pub.close()
        worker.stop()
        if second is not None:
            second.stop()
    done_ts = seen.timestamps
    finished_ts: dict[str, int] = {}
    group_of = {s.finished.session_id: s.finished.group_id for g in paced for s in g}
    for m in events:
        gid = group_of.get(m.key.decode())
        if gid is not None:
            finished_ts[gid] = max(finished_ts.get(gid, 0), m.timestamp_ms)
    latencies = [float(done_ts[g] - t) for g, t in finished_ts.items() if g in done_ts]
    one = sorted(passes[1], key=lambda p: p["calls_per_s"])
    two = sorted(passes[2], key=lambda p: p["calls_per_s"])
    drains = sorted(passes["drain"], key=lambda p: p["calls_per_s"])
    return {"burst": one[len(one) // 2],  # the median pass
            "burst_passes": passes[1],
            "burst_calls_per_s": {"min": one[0]["calls_per_s"], "median": one[len(one) // 2]["calls_per_s"],
                                  "max": one[-1]["calls_per_s"]},
            "burst_calls_per_worker_cpu_s_median": statistics.median(p["calls_per_worker_cpu_s"] for p in passes[1]),
            "two_workers": {"passes": passes[2],
                            "calls_per_s": {"min": two[0]["calls_per_s"], "median": two[len(two) // 2]["calls_per_s"],
                                            "max": two[-1]["calls_per_s"]}} if two else None,
            "drain": {"passes": passes["drain"],
                      "calls_per_s": {"min": drains[0]["calls_per_s"], "median": drains[len(drains) // 2]["calls_per_s"],
                                      "max": drains[-1]["calls_per_s"]},
                      "calls_per_worker_cpu_s_median": statistics.median(p["calls_per_worker_cpu_s"] for p in drains)}
            if drains else None,
            "latency_finished_to_group_ms": {"groups": len(latencies), "p50": pct(latencies, 0.5),
                                             "p99": pct(latencies, 0.99), "max": max(latencies)}}


def wait_for_members(settings: Settings, n: int, timeout: float = 120.0) -> None:
    """Until the workers' consumer group is stable with ``n`` members, each owning partitions."""
    from confluent_kafka import ConsumerGroupState
    from confluent_kafka.admin import AdminClient

    from streams.topology import app_id_for

    admin, group = AdminClient(settings.kafka_config()), app_id_for(settings)
    deadline = time.monotonic() + timeout
    while True:
        d = admin.describe_consumer_groups([group], request_timeout=10)[group].result()
        owning = [m for m in d.members if m.assignment and m.assignment.topic_partitions]
        if d.state == ConsumerGroupState.STABLE and len(d.members) == len(owning) == n:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{group}: {len(d.members)} members ({len(owning)} owning partitions), state "
                               f"{d.state}, after {timeout:.0f}s; wanted {n}")
        time.sleep(0.5)


VOCAB = 151_643  # Qwen2.5's vocabulary


def incompressible_tokenize(text: str) -> list[int]:
    """One id per word, drawn uniformly over VOCAB from the text's hash: a stand-in whose ids are as
    hard to compress as ids get (real text reuses frequent ids), so Kafka's compression is not flattered
    by the synthetic sessions' 16-word vocabulary."""
    words = text.split()
    rnd = random.Random(hashlib.sha256(text.encode()).digest())
    return [rnd.randrange(VOCAB) for _ in words]


def log_bytes(log_dir: Path, prefix: str) -> dict[str, int]:
    """Bytes of the broker's log segments per topic whose name starts with ``prefix`` (partitions summed)."""
    out: dict[str, int] = {}
    for part in log_dir.iterdir():
        topic = part.name.rsplit("-", 1)[0]
        if part.is_dir() and topic.startswith(prefix):
            name = topic[len(prefix):]
            out[name] = out.get(name, 0) + sum(f.stat().st_size for f in part.glob("*.log"))
    return out


def bench_bytes(settings: Settings, log_dir: Path, turns_list: list[int], groups: int, words: dict, tmp: Path) -> dict:
    """Kafka bytes per session, at each number of turns, over the raw int32 bytes of the session's
    distinct tokens (what prefix merging trains on: every token position of the session once), with
    records packed (the default record format) and, in the pass after it on the same sessions, JSON."""
    out = {}
    for turns in turns_list:
        recorded = sessions(groups, turns, words, f"t{turns}-", seed=7, tokenize=incompressible_tokenize)
        flat = [s for g in recorded for s in g]
        raw = 4 * sum(len(t.token_ids) for s in flat
                      for t in assemble([CallTokens.from_record(c) for c in s.calls], "prefix_merging").traces)
        row: dict = {"sessions": len(flat), "raw_int32_bytes_per_session": round(raw / len(flat))}
        for fmt, suffix in (("packed", ""), ("json", "_json")):
            by_topic = _bytes_pass(settings.model_copy(update={"record_format": fmt}), log_dir, flat, groups, tmp, f"{turns}-{fmt}")
            total = sum(by_topic.values())
            row.update({f"kafka_bytes_per_session{suffix}": round(total / len(flat)), f"over_raw{suffix}": round(total / raw, 2),
                        f"by_topic_per_session{suffix}": {k: round(v / len(flat)) for k, v in sorted(by_topic.items())}})
        out[str(turns)] = row
    return out


def _bytes_pass(settings: Settings, log_dir: Path, flat: list[Recorded], groups: int, tmp: Path, tag: str) -> dict[str, int]:
    """One pass with its own topic prefix and worker, records written in ``settings.record_format``:
    bytes of the broker's log segments (compressed as stored) of every topic of that prefix (calls,
    session events, trajectories, groups, the worker's changelogs and ticks)."""
    settings = settings.model_copy(update={"topic_prefix": f"bytes{uuid.uuid4().hex[:6]}."})
    ensure_topics(settings)
    worker = WorkerProcess(settings, tmp / f"bytes-{tag}.log", ["--tick-interval", "1"]).start()
    try:
        publish(settings, [r for s in flat for r in s.records])
        read_topic(settings, "groups", until=lambda m: len({x.key for x in m}) >= groups, timeout=300)
        read_topic(settings, "trajectories", timeout=60, idle=2.0, until=lambda m: len(m) >= len(flat))
        time.sleep(2)  # the changelog writes of the last group's clean-up
    finally:
        worker.stop()
    return log_bytes(log_dir, settings.topic_prefix)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sessions and fewer groups: under a minute")
    parser.add_argument("--bootstrap", help="use this broker instead of starting one")
    args = parser.parse_args()
    if args.quick:
        turns, words, n_burst, n_paced, repeat, rounds = 8, {"tokens_per_turn": 40, "system_words": 400, "tool_words": 80}, 12, 10, 3, 3
    else:
        turns, words, n_burst, n_paced, repeat, rounds = 24, {"tokens_per_turn": 80, "system_words": 3000, "tool_words": 300}, 40, 30, 3, 5
    recorded = sessions(n_burst, turns, words, "b")
    flat = [s for g in recorded for s in g]
    result = {"bench": "streams", "quick": args.quick, "cpus": os.cpu_count(),
              "sessions": {"count": len(flat), "calls_per_session": round(statistics.fmean(len(s.calls) for s in flat), 1),
                           "turns": turns, **words}}
    result["assembly"] = bench_assembly(flat, repeat, rounds)
    result["state"] = bench_state(flat)
    result["builders"] = bench_builders(flat)

    with tempfile.TemporaryDirectory(prefix="polar-bench-streams-") as tmp:
        broker = None
        if args.bootstrap:
            settings = Settings(kafka_bootstrap=args.bootstrap, data_dir=Path(tmp))
        else:
            from infra.kafka import KafkaBroker

            port = free_port()
            settings = Settings(data_dir=Path(tmp), kafka_port=port, kafka_controller_port=free_port(),
                                kafka_bootstrap=f"127.0.0.1:{port}")
            broker = KafkaBroker(settings, die_with_parent=True, quick_jit=args.quick)
            broker.start()
        try:
            settings = settings.model_copy(update={"topic_prefix": f"bench{uuid.uuid4().hex[:6]}."})
            ensure_topics(settings)
            paced = sessions(n_paced, turns, words, "p", seed=1000)
            # 1 and 2 worker processes and one worker draining a backlog, interleaved
            plan = [1, "drain", 2] if args.quick else [1, "drain", 2, 1, "drain", 2, 1]
            more = [sessions(n_burst, turns, words, f"b{i}-", seed=100 * i) for i in range(1, len(plan))]
            result["worker"] = worker = bench_worker(settings, [recorded, *more], paced, Path(tmp), plan)
            # the headline keys (#21); the worker shares this machine's cores with the broker and
            # this process, so calls per worker CPU-second says what one worker does on a core of its own
            result["worker_calls_per_s"] = worker["burst_calls_per_s"]["median"]
            result["two_workers_calls_per_s"] = worker["two_workers"]["calls_per_s"]["median"]
            result["worker_calls_per_cpu_s"] = worker["burst_calls_per_worker_cpu_s_median"]
            result["worker_drain_calls_per_s"] = worker["drain"]["calls_per_s"]["median"]
            result["group_latency_p99_ms"] = worker["latency_finished_to_group_ms"]["p99"]
            if broker is None:
                result["bytes_per_session_over_raw"] = None
                result["bytes_per_session_over_raw_reason"] = "--bootstrap: the broker's log segments are not on this machine"
            else:
                turns_list = [4, 8, 16] if args.quick else [12, 24, 48]
                result["bytes"] = bench_bytes(settings, broker.log_dir, turns_list, 1 if args.quick else 4, words, Path(tmp))
                result["bytes_per_session_over_raw"] = result["bytes"][str(turns_list[1])]["over_raw"]
                result["bytes_per_session_over_raw_json"] = result["bytes"][str(turns_list[1])]["over_raw_json"]
        finally:
            if broker is not None:
                broker.stop()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
