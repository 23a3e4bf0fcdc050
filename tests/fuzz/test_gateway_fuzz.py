"""A short fuzz pass of the four provider APIs against a live gateway (real Kafka, scripted tiny engine).

Every answer must be a success in the provider's shape or an error in its own error shape (no 5xx but
the documented engine/Kafka ones, no dropped connection, no hang), and every answered call must be on
the calls topic: recorded == answered, exactly. ``POLAR_FUZZ_PROFILE=polar-fuzz-long`` raises the count;
the 10,000-per-API run is ``bench/fuzz.py``.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from gateway.limits import Limits

from .client import send_all, summarize
from .strategies import PROVIDERS, collect_mix, profile

LIMITS = Limits(max_messages=1_000, max_tools=256, body_timeout_s=10)
GATEWAY = dict(max_body_bytes=1 << 20, upstream_timeout_s=30, publish_timeout_s=10, max_model_len=4096, limits=LIMITS)
SESSIONS = 6


@pytest.fixture(scope="module")
def cases() -> dict[str, list]:
    n = int(os.environ.get("POLAR_FUZZ_EXAMPLES", profile().max_examples))
    return {p: collect_mix(p, n) for p in PROVIDERS}


@pytest.mark.timeout(300)
def test_fuzzed_requests_get_provider_shaped_answers_and_every_answer_is_recorded(
        polar_settings, scripted_engine, gateway_factory, cases):
    from tests.plugins.gateway import CallsReader

    gw = gateway_factory(polar_settings, scripted_engine.url, **GATEWAY)
    keys = [gw.key(f"fuzz-{i}") for i in range(SESSIONS)]
    outcomes = []
    for provider in PROVIDERS:
        outcomes += asyncio.run(send_all(gw.url, keys, cases[provider], concurrency=4, timeout=60))
    problems = [(o.provider, o.family, o.error_class, o.problem) for o in outcomes if o.problem]
    assert not problems, problems[:10]

    answered = {o.event_id for o in outcomes if o.event_id}
    reader = CallsReader(polar_settings)
    try:  # failed calls are recorded too, so a count alone can be reached before every answer is read
        recorded = reader.wait(len(answered), timeout=60)
        deadline = time.monotonic() + 60
        while not answered <= {r.event_id for r in recorded} and time.monotonic() < deadline:
            recorded = reader.wait(len(recorded) + 1, timeout=2)
    finally:
        reader.close()
    succeeded = {r.event_id for r in recorded if not r.error}  # failed calls are recorded too, with ``error``
    report = summarize(outcomes, {r.event_id for r in recorded})
    assert answered == succeeded, report  # nothing answered unrecorded, no recorded success unanswered
    for provider in PROVIDERS:  # the mix really reached the engine and really hit the error paths
        entry = report[provider]
        assert entry["answered"] > 0 and any(c.startswith("4") for c in entry["error_classes"]), entry
