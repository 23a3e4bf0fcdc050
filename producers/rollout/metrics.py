"""The rollout server's Prometheus metrics, read from its task progress when Prometheus scrapes.

The server sees sessions through their events, so its stages are the progress stages
(producers/rollout/progress.py): ``assigned`` (on polar.sessions: in a node's INIT or READY, or not yet
taken), ``started`` (RUN), ``harness_exited`` and ``evaluated`` (POSTRUN), ``finished``. A node's own
INIT/READY/RUN/POSTRUN gauges are on its gateway's /metrics (gateway/node/metrics.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from infra.metrics import Reading, Sampled

from .progress import STAGES


def _sessions(rollout: Any) -> Iterator[Reading]:
    stages = Counter(s.stage for t in rollout.tasks.values() for s in t.samples.values())
    for stage in STAGES:
        yield (stage,), float(stages[stage])


def _tasks(rollout: Any) -> Iterator[Reading]:
    states = Counter(t.summary()["state"] for t in rollout.tasks.values())
    for state in ("running", "done", "cancelled"):
        yield (state,), float(states[state])


def _events(rollout: Any) -> Iterator[Reading]:
    yield (), float(rollout.events_seen)


_GAUGES = (
    Sampled("polar_rollout_sessions", "Sessions of the known tasks by progress stage (assigned, started, "
            "harness_exited, evaluated, finished)", ("stage",), _sessions),
    Sampled("polar_rollout_tasks", "Known tasks by state (running, done, cancelled)", ("state",), _tasks),
    Sampled("polar_rollout_session_events", "SessionEvents the server has read", (), _events, counter=True),
)


def watch(rollout: Any) -> None:
    """Report ``rollout`` (the server's Rollout state) until it is garbage collected."""
    for gauge in _GAUGES:
        gauge.watch(rollout)
