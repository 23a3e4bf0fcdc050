"""Serving Prometheus metrics: the ``/metrics`` route of an app, or a thread for a process without one.

Each component keeps its own metric objects in its own module (gateway/metrics.py, streams/metrics.py,
trainer/metrics.py, producers/rollout/metrics.py, gateway/node/metrics.py); they all live in
prometheus_client's process-wide registry, and this module serves it. Metrics carry counts and timings
only, never content (no session ids, prompts or keys), so ``/metrics`` needs no token, like ``/health``.
docs/operations.md lists every metric.

``Sampled`` is a gauge (or counter) read at scrape time from live objects (a gateway's session store, a
node's pipeline): the objects register themselves and are dropped when garbage, so several in one
process (tests, a node hosting its gateway) neither clash nor leak.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# One sample of a Sampled gauge: its label values (in labelnames order) and the value.
Reading = tuple[tuple[str, ...], float]


async def metrics_endpoint(request: Any) -> Any:
    """``GET /metrics`` for a Starlette/FastAPI app, in the Prometheus text format."""
    from starlette.responses import Response

    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


def mount(app: Any) -> None:
    """Add ``GET /metrics`` to a FastAPI app (kept out of its OpenAPI document: it is not the API)."""
    app.add_route("/metrics", metrics_endpoint, methods=["GET"], include_in_schema=False)


def serve(port: int, host: str = "0.0.0.0") -> int:
    """Serve ``/metrics`` on ``host:port`` from a daemon thread (port 0: a free one); returns the port.

    A port in use raises OSError(EADDRINUSE), which ``polarstream`` turns into one line.
    """
    server, _ = start_http_server(port, addr=host)
    return int(server.server_port)


class Sampled(Collector):
    """A gauge whose value is read from live objects when Prometheus scrapes.

    ``read(source)`` yields ``(label values, value)``; values of the same labels from several sources
    are summed (two gateways in one process report their sessions together). ``counter=True`` exposes
    a count that only grows (a ``_total`` series) instead of a gauge.
    """

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...],
                 read: Callable[[Any], Iterable[Reading]], counter: bool = False):
        self.name, self.documentation, self.labelnames, self.read = name, documentation, labelnames, read
        self.family = CounterMetricFamily if counter else GaugeMetricFamily
        # by id: some sources are dataclasses (eq, so unhashable), and a WeakSet needs hashing
        self.sources: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        REGISTRY.register(self)

    def watch(self, source: Any) -> None:
        """Report ``source`` from now on, until it is garbage collected."""
        self.sources[id(source)] = source

    def describe(self) -> Iterator[Any]:
        yield self.family(self.name, self.documentation, labels=list(self.labelnames))

    def collect(self) -> Iterator[Any]:
        totals: dict[tuple[str, ...], float] = defaultdict(float)
        for source in list(self.sources.values()):
            for labels, value in self.read(source):
                totals[labels] += value
        family = self.family(self.name, self.documentation, labels=list(self.labelnames))
        for labels, value in sorted(totals.items()):
            family.add_metric(list(labels), value)
        yield family
