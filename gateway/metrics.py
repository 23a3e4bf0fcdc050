"""The gateway's Prometheus metrics and the one-line functions that record them.

The request path calls the ``record_*`` functions (gateway/service.py); state gauges (sessions held,
calls in flight, paused, policy version) are read from the live ``Gateway`` when Prometheus scrapes, so
the hot path pays nothing for them. ``create_app`` registers the gateway with ``watch`` and mounts
``GET /metrics`` (infra/metrics.py). Every metric is listed in docs/operations.md.

*Added latency* is what the gateway adds to the engine's time: a call's total minus its upstream time
(tokenizing, parsing, the durable publish). That is the number the gateway's own work is judged by.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import Counter, Histogram

from infra.metrics import Reading, Sampled

# Sub-millisecond to seconds: a healthy gateway adds a few ms; a slow broker shows up in the tail.
_FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

CALLS = Counter("polar_gateway_calls", "Model calls answered, by provider API and outcome (ok | error)",
                ["provider", "status"])
ERRORS = Counter("polar_gateway_errors", "Calls answered with an error, by error class (RequestError.kind)",
                 ["error_class"])
ADDED_LATENCY = Histogram("polar_gateway_added_latency_seconds",
                          "Time the gateway adds to a call: total minus the engine's time", ["provider"],
                          buckets=_FAST_BUCKETS)
PUBLISH_LATENCY = Histogram("polar_gateway_publish_seconds",
                            "Time from handing a CallRecorded to the producer to the broker's acknowledgement",
                            buckets=_FAST_BUCKETS)
# An answered call's pipeline in order (gateway/service.py). upstream_client is the generate step minus the
# engine's round trip as the upstream client times it (the same split as added latency), so each stage is the
# gateway's own; what is left of the added latency is HTTP, parsing the request and rendering the answer.
STAGES = ("scrub", "tokenize", "upstream_client", "record", "publish")
STAGE_LATENCY = Histogram("polar_gateway_stage_seconds",
                          "An answered call's time in each stage of the gateway's pipeline: " + ", ".join(STAGES),
                          ["stage"], buckets=_FAST_BUCKETS)
_STAGE_SERIES = [STAGE_LATENCY.labels(s) for s in STAGES]  # bound once: the hot path only observes
CHAIN_BREAKS = Counter("polar_gateway_chain_breaks", "Calls that started a new chain, by break reason "
                       "(first_call, side_call, system_changed, ...)", ["reason"])


def record_call(provider: str, status: str, added_s: float) -> None:
    """One answered call: ``status`` "ok" or "error"; ``added_s`` its total minus its upstream seconds."""
    CALLS.labels(provider, status).inc()
    ADDED_LATENCY.labels(provider).observe(max(0.0, added_s))


def record_error(error_class: str) -> None:
    """One call answered with an error of ``error_class`` (e.g. "rate_limit_error", "api_error")."""
    ERRORS.labels(error_class or "unknown").inc()


def record_publish(seconds: float) -> None:
    """One publish of a call, acknowledged after ``seconds``."""
    PUBLISH_LATENCY.observe(seconds)


def record_stages(seconds: Sequence[float]) -> None:
    """One answered call's seconds in each of STAGES, in that order."""
    for series, value in zip(_STAGE_SERIES, seconds):
        series.observe(max(0.0, value))


def record_chain_break(reason: str) -> None:
    """One call that did not extend the session's chain, for ``reason``."""
    CHAIN_BREAKS.labels(reason or "unknown").inc()


def _sessions(gw: Any) -> Iterator[Reading]:
    yield (), float(len(gw.sessions))


def _in_flight(gw: Any) -> Iterator[Reading]:
    yield (), float(gw.gate.in_flight)


def _paused(gw: Any) -> Iterator[Reading]:
    yield (), float(gw.gate.paused)


def _auto_resumed(gw: Any) -> Iterator[Reading]:
    yield (), float(gw.gate.auto_resumed)


def _policy_version(gw: Any) -> Iterator[Reading]:
    yield (), float(gw.policy_version)


_STATE = (
    Sampled("polar_gateway_sessions", "Sessions whose state the gateway holds", (), _sessions),
    Sampled("polar_gateway_calls_in_flight", "Calls inside the pause gate now", (), _in_flight),
    Sampled("polar_gateway_paused", "1 while the gateway holds new calls for a weight swap", (), _paused),
    Sampled("polar_gateway_pause_expired", "Pauses that outlived their deadline and were lifted by the gateway",
            (), _auto_resumed),
    Sampled("polar_gateway_policy_version", "Policy version stamped on calls whose engine reports none", (),
            _policy_version),
)


def watch(gateway: Any) -> None:
    """Report ``gateway``'s state gauges (until it is garbage collected)."""
    for gauge in _STATE:
        gauge.watch(gateway)
