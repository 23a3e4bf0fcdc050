"""The stream worker's Prometheus metrics: consumer lag, open sessions, group latency, event counters.

``polarstream streams worker --metrics-port N`` serves them (infra/metrics.py). Lag and open sessions
are refreshed by the worker's stats timer (every ``--stats-interval`` seconds), because they need the
consumer and the tables, which belong to Faust's event loop; the counters are the runtime's own named
counters (runtime.py), read when Prometheus scrapes. Every metric is listed in docs/operations.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
from prometheus_client import Gauge, Histogram

from infra.metrics import Reading, Sampled

LAG = Gauge("polar_streams_consumer_lag", "Messages of an input partition this worker owns that it has not "
            "processed yet (high watermark minus next offset to process)", ["topic", "partition"])
SESSIONS_OPEN = Gauge("polar_streams_sessions_open", "Sessions this worker holds that are not assembled yet")
GROUPS_OPEN = Gauge("polar_streams_groups_open", "Groups this worker holds that are not emitted yet")
# From a group's first trajectory to its TrainingGroup: as long as the slowest sample of the group.
GROUP_LATENCY = Histogram("polar_streams_group_latency_seconds", "Seconds from a group's first trajectory to "
                          "its emitted TrainingGroup", buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800))


def _counters(rt: Any) -> Iterator[Reading]:
    for name, n in rt.counters.items():
        if not name.endswith("_us"):  # busy time is a duration, not an event count
            yield (name,), float(n)


_EVENTS = Sampled("polar_streams_events", "What happened to input events and outputs, by the runtime's "
                  "counter name (calls.new, calls.duplicate, groups.sent, ...)", ("name",), _counters, counter=True)


def watch(rt: Any) -> None:
    """Report the counters of ``rt`` (a streams Runtime) until it is garbage collected."""
    _EVENTS.watch(rt)


def observe_group(seconds: float) -> None:
    """A group was emitted ``seconds`` after its first trajectory arrived."""
    GROUP_LATENCY.observe(max(0.0, seconds))


async def refresh(rt: Any, sessions: str, groups: str) -> None:
    """Set lag and open-state gauges from the worker's consumer and tables (in Faust's event loop);
    ``sessions`` and ``groups`` name the two agents' state tables (group_agent.py imports this module)."""
    app, topo = rt.app, rt.topo
    inputs = {topo.calls, topo.session_events, topo.trajectories}
    LAG.clear()  # partitions move between workers: report only what this one owns now
    for tp in app.assignor.assigned_actives():
        if tp.topic not in inputs:
            continue
        high = app.consumer.highwater(tp) or 0
        done = rt.processed.get((tp.topic, tp.partition))
        nxt = done + 1 if done is not None else (await app.consumer.position(tp) or 0)
        LAG.labels(tp.topic, str(tp.partition)).set(max(0, high - nxt))
    SESSIONS_OPEN.set(_open(rt.tables[sessions], "done"))
    GROUPS_OPEN.set(_open(rt.tables[groups], "emitted"))


def _open(table: Any, marker: str) -> int:
    """Entries of a state table whose ``marker`` field is still empty (not done yet)."""
    return sum(not orjson.loads(raw).get(marker) for raw in list(table.values()))
