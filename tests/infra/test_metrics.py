"""Prometheus metrics in-process: what the record functions and live gauges put on /metrics, read back
with prometheus_client's own parser (the demo test scrapes every service during a real run)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway import metrics as gateway_metrics
from infra.metrics import Sampled, serve


def scrape(text: str | None = None) -> dict[tuple[str, frozenset], float]:
    text = text if text is not None else generate_latest(REGISTRY).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_gateway_record_functions_move_their_series():
    before = scrape()

    def moved(name: str, **labels) -> float:
        key = (name, frozenset(labels.items()))
        return scrape().get(key, 0.0) - before.get(key, 0.0)

    gateway_metrics.record_call("openai.chat", "ok", 0.003)
    gateway_metrics.record_call("openai.chat", "ok", -1.0)  # clock skew never makes a negative bucket
    gateway_metrics.record_error("rate_limit_error")
    gateway_metrics.record_publish(0.002)
    gateway_metrics.record_chain_break("system_changed")
    gateway_metrics.record_stages([0.0001, 0.002, 0.0004, -0.001, 0.0012])
    assert moved("polar_gateway_calls_total", provider="openai.chat", status="ok") == 2
    assert moved("polar_gateway_added_latency_seconds_bucket", provider="openai.chat", le="0.005") == 2
    assert moved("polar_gateway_errors_total", error_class="rate_limit_error") == 1
    assert moved("polar_gateway_publish_seconds_count") == 1
    assert moved("polar_gateway_chain_breaks_total", reason="system_changed") == 1
    assert moved("polar_gateway_stage_seconds_sum", stage="tokenize") == pytest.approx(0.002)
    assert moved("polar_gateway_stage_seconds_bucket", stage="record", le="0.0005") == 1  # never negative
    assert all(moved("polar_gateway_stage_seconds_count", stage=s) == 1 for s in gateway_metrics.STAGES)


class _Source:
    def __init__(self, n: int):
        self.n = n


def test_sampled_gauges_sum_live_sources_and_forget_dead_ones():
    gauge = Sampled("polar_test_things", "things held", ("kind",), lambda s: [(("a",), float(s.n))])
    try:
        one, two = _Source(2), _Source(3)
        gauge.watch(one)
        gauge.watch(two)
        assert scrape()[("polar_test_things", frozenset({("kind", "a")}))] == 5.0
        del two
        assert scrape()[("polar_test_things", frozenset({("kind", "a")}))] == 2.0
    finally:
        REGISTRY.unregister(gauge)


def test_serve_answers_metrics_on_a_free_port():
    port = serve(0, "127.0.0.1")
    values = scrape(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text)
    assert any(name.startswith("polar_gateway_") for name, _ in values)
