"""A capacity plan derived from measured per-call costs: docs/capacity.md's table (``<!-- bench:capacity:plan -->``).

A model, not a measurement: every row multiplies figures that bench/results/latest.json holds, measured
on the 2-core machine, by a call rate, with the assumptions below stated on the page. Its inputs:

- gateway CPU ms per proxied call (bench/gateway.py ``gateway_cpu_ms_per_call``: the gateway process's own
  CPU counters over the 16-client load, sessions of 30-80 KB calls, durable publish included);
- stream-worker calls per CPU-second (bench/streams.py ``worker_calls_per_cpu_s``: 24-turn sessions);
- Kafka bytes and distinct tokens per call (bench/streams.py ``bytes`` at 24 turns: every topic a session
  writes, compressed as stored, tokens drawn from a 151k vocabulary, a worst case for compression);
- broker CPU µs per 4 KB event (bench/publisher.py, acks=all, idempotent, batched), scaled by a call's bytes.
"""

from __future__ import annotations

import math

from bench.render import dig as _dig

SOURCES = ("gateway", "streams", "publisher")  # the benchmarks whose figures it uses
RATES = (1_000, 10_000, 100_000)  # model calls per second
UTILISATION = 0.7  # plan each process and core for 70% busy: headroom for bursts, GC and rebalances
REPLICATION = 3  # topics at replication factor 3 (infra/topics.yaml: auto = min(3, brokers))
PARTITION_STEP = 4  # partition counts rounded up to a multiple of this (room to add workers)


def inputs(run: dict) -> dict:
    """The measured per-call figures the plan uses (None where a benchmark has not measured one)."""
    b = run.get("benchmarks") or {}
    gw, st, pub = (_dig(b, n, "result") or {} for n in ("gateway", "streams", "publisher"))
    bytes24, calls = _dig(st, "bytes", "24") or {}, _dig(st, "sessions", "calls_per_session")
    per_call = (lambda x: x / calls) if calls else (lambda x: None)
    publish = next((r for r in pub.get("results", []) if r.get("size_bytes") == 4096), {})
    return {
        "gateway_cpu_ms_per_call": gw.get("gateway_cpu_ms_per_call"),
        "worker_calls_per_cpu_s": st.get("worker_calls_per_cpu_s"),
        "kafka_bytes_per_call": per_call(bytes24["kafka_bytes_per_session"]) if "kafka_bytes_per_session" in bytes24 else None,
        "tokens_per_call": per_call(bytes24["raw_int32_bytes_per_session"] / 4) if "raw_int32_bytes_per_session" in bytes24 else None,
        "broker_us_per_event": _dig(publish, "unbounded", "publish_many", "cpu_us_per_event", "broker"),
    }


def plan(run: dict) -> list[dict]:
    """One row per call rate; a figure whose input is missing is None."""
    x = inputs(run)

    def need(value, f):
        return None if value is None else f(value)

    rows = []
    for n in RATES:
        workers = need(x["worker_calls_per_cpu_s"], lambda w: math.ceil(n / (w * UTILISATION)))
        produced = need(x["kafka_bytes_per_call"], lambda bpc: n * bpc)
        rows.append({
            "calls_per_s": n,
            "gateway_processes": need(x["gateway_cpu_ms_per_call"], lambda g: math.ceil(n * g / 1000 / UTILISATION)),
            "stream_workers": workers,
            "calls_partitions": need(workers, lambda w: PARTITION_STEP * math.ceil(w / PARTITION_STEP)),
            "broker_produce_mb_per_s": need(produced, lambda p: p / 1e6),
            "broker_write_mb_per_s_replicated": need(produced, lambda p: p * REPLICATION / 1e6),
            "broker_disk_tb_per_day_replicated": need(produced, lambda p: p * REPLICATION * 86_400 / 1e12),
            # the publisher bench's broker CPU per 4 KB event, scaled to the bytes a call writes
            "broker_cores": need(x["broker_us_per_event"], lambda us: need(produced, lambda p: p / 4096 * us * REPLICATION / 1e6
                                                                                         / UTILISATION)),
            "trainer_tokens_per_s": need(x["tokens_per_call"], lambda t: n * t),
        })
    return rows


def _fmt(v) -> str:
    if v is None:
        return "not measured"
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:,.0f}" if v >= 100 else f"{v:,.1f}" if v >= 10 else f"{v:.2f}"


def render(run: dict) -> str:
    """The plan as a markdown table and the inputs it was derived from."""
    x, rows = inputs(run), plan(run)
    head = ["model calls/s", "gateway processes", "stream workers", "polar.calls partitions", "Kafka produce MB/s",
            "written MB/s (×3 replicas)", "disk TB/day (×3)", "broker cores", "trainer tokens/s"]
    keys = ["calls_per_s", "gateway_processes", "stream_workers", "calls_partitions", "broker_produce_mb_per_s",
            "broker_write_mb_per_s_replicated", "broker_disk_tb_per_day_replicated", "broker_cores", "trainer_tokens_per_s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    lines += ["| " + " | ".join(_fmt(r[k]) for k in keys) + " |" for r in rows]
    derived = ", ".join(f"{k} = {_fmt(v)}" for k, v in x.items())
    return ("\n**A model, derived from measured per-call figures** (not a measurement at these rates):\n\n"
            + "\n".join(lines) + f"\n\nInputs: {derived}.\n")
