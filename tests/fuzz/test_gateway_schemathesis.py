"""Schemathesis against the gateway's own OpenAPI document (``GET /openapi.json``, ``gateway/openapi.py``).

A live gateway (real Kafka, scripted tiny engine) gets positive and negative (schema-violating) cases
for every operation, each with a minted session key in the header its provider's SDK uses. Every answer
must conform to the document: a documented status (no 5xx but the engine/Kafka ones), the documented
content type, and a body in the documented shape (the provider's success or its own error shape). Then
every answered call must be on the calls topic. Deterministic; ``POLAR_SCHEMATHESIS_EXAMPLES`` sets the
number of cases per operation and mode.
"""

from __future__ import annotations

import os
import time
import uuid

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.limits import Limits
from gateway.openapi import openapi_document

from .client import DOCUMENTED_5XX, auth_headers, error_kind, success_id

# Small limits, so negative cases cross them (maxItems, ...) with small bodies.
LIMITS = Limits(max_messages=200, max_tools=64, body_timeout_s=10)
GATEWAY = dict(max_body_bytes=1 << 20, upstream_timeout_s=30, publish_timeout_s=10, max_model_len=4096, limits=LIMITS)
schema = schemathesis.openapi.from_dict(openapi_document(LIMITS, GATEWAY["max_body_bytes"]))
EXAMPLES = int(os.environ.get("POLAR_SCHEMATHESIS_EXAMPLES", 10))
CHECKS = [status_code_conformance, content_type_conformance, response_headers_conformance, response_schema_conformance]
PROVIDER = {  # path prefix -> the provider whose shapes (and key header) the operation uses
    "/v1/messages": "anthropic.messages", "/v1/chat/completions": "openai.chat",
    "/v1/responses": "openai.responses", "/v1beta/": "google.generate_content",
}  # fmt: skip
GENERATE = {"/v1/messages", "/v1/chat/completions", "/v1/responses", "/v1beta/models/{model}:generateContent",
            "/v1beta/models/{model}:streamGenerateContent"}  # fmt: skip
KEY_PLACES = ("authorization", "x-api-key", "x-goog-api-key")
OPERATIONS = [r.ok() for r in schema.get_all_operations()]


def provider_of(path: str) -> str:
    return next((p for prefix, p in PROVIDER.items() if path.startswith(prefix)), "")


def context_overflow(provider: str, body: dict) -> bool:
    """Whether an error body is the provider's "prompt too long" (a valid request may still not fit)."""
    err = body.get("error") or {}
    if provider.startswith("openai."):
        return err.get("code") == "context_length_exceeded"
    return err.get("message", "").startswith(("prompt is too long", "The input token count"))


@pytest.fixture(scope="module")
def live(infra, scripted_engine, tiny_model_dir, tiny_template):
    """One gateway for the module on its own topic prefix, and a calls reader kept open across tests."""
    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from gateway.server import ThreadedServer
    from schemas.session_keys import mint_session_key
    from infra.topics import ensure_topics
    from tests.plugins.gateway import CallsReader

    polar = infra.settings.model_copy(update={"topic_prefix": f"t{uuid.uuid4().hex[:10]}."})
    ensure_topics(polar)
    config = GatewayConfig(engine_urls=[scripted_engine.url], model=str(tiny_model_dir), **GATEWAY)
    server = ThreadedServer(create_app(polar, config, template=tiny_template)).start()
    server.key = lambda sid: mint_session_key(sid, polar.session_secret)
    server.reader = CallsReader(polar)
    yield server
    server.reader.close()
    server.stop()


def test_gateway_serves_the_document_it_is_fuzzed_against(live):
    r = httpx.get(live.url + "/openapi.json", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text[:200]
    assert r.json() == openapi_document(LIMITS, GATEWAY["max_body_bytes"])
    # only the exact path: under a prefix, GET stays the catch-all's (Chat-shaped 404)
    prefixed = httpx.get(live.url + "/gw/openapi.json", timeout=10)
    assert prefixed.status_code == 404 and error_kind("openai.chat", prefixed.json()), prefixed.text


def exercise(operation, mode: GenerationMode, base: str, key: str) -> list[str]:
    """Send ``EXAMPLES`` cases of ``mode`` and check each answer; the ids of answered calls."""
    path, provider = operation.path, provider_of(operation.path)
    answered: list[str] = []

    # No shrinking: schemathesis' bodies are large and a shrink of one failure can outlast the CI timeout.
    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(generation_mode=mode))
    def one(case) -> None:
        headers = {k: v for k, v in (case.headers or {}).items() if k.lower() not in KEY_PLACES}
        case.headers = {**headers, **(auth_headers(provider, key) if provider else {})}
        response = case.call(base_url=base, timeout=60)
        case.validate_response(response, checks=CHECKS)
        status, ctype = response.status_code, (response.headers.get("content-type") or [""])[0]
        assert status < 500 or status in DOCUMENTED_5XX, (status, response.content[:300])
        if status >= 400 and provider:
            assert error_kind(provider, response.json()), response.content[:300]  # belt and braces: the shape's values
        if mode == GenerationMode.POSITIVE:  # the document is accurate: what it allows is accepted (or too long)
            assert status < 400 or context_overflow(provider, response.json()), (status, response.content[:300])
        if status == 200 and path in GENERATE:
            rid = success_id(provider, response.content, ctype.startswith("text/event-stream"))
            assert rid, response.content[:300]
            answered.append(rid)

    one()
    return answered


@pytest.mark.timeout(300)
@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.label for op in OPERATIONS])
def test_gateway_answers_schema_cases_as_documented_and_records_them(operation, live):
    has_input = bool(operation.body) or any(True for _ in operation.iter_parameters())
    modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if has_input else [])
    key = live.key(f"schemathesis-{operation.label}")
    answered = [rid for mode in modes for rid in exercise(operation, mode, live.url, key)]
    if operation.path not in GENERATE:
        return
    assert answered, "no positive case reached the engine"
    deadline = time.monotonic() + 60
    recorded: set[str] = set()
    while not set(answered) <= recorded and time.monotonic() < deadline:
        live.reader.wait(len(live.reader.records) + 1, timeout=2, settle=0)
        recorded = {r.event_id for r in live.reader.records if not r.error}
    assert set(answered) <= recorded, sorted(set(answered) - recorded)[:10]


@pytest.mark.parametrize("operation", [op for op in OPERATIONS if op.path != "/health" and op.path != "/v1/models"],
                         ids=lambda op: op.label)
def test_calls_without_a_valid_key_get_a_documented_401(operation, live):
    path = operation.path.replace("{model}", "tiny")
    provider = provider_of(operation.path)
    for headers in ({}, auth_headers(provider, "not-a-session-key")):
        r = httpx.post(live.url + path, json={}, headers=headers, timeout=10)
        assert r.status_code == 401 and error_kind(provider, r.json()), (headers, r.text)


def test_routing_errors_answer_in_the_provider_shape(live):
    """Found by schemathesis: a newline in a Gemini model name slipped past the catch-all (FastAPI's 404)."""
    key = live.key("schemathesis-regressions")
    google = auth_headers("google.generate_content", key)
    r = httpx.post(live.url + "/v1beta/models/a%0Ab:generateContent", json={"contents": []}, headers=google, timeout=10)
    assert r.status_code == 404 and error_kind("google.generate_content", r.json()) == "NOT_FOUND", r.text
    r = httpx.put(live.url + "/gw/v1/messages", json={}, headers=auth_headers("anthropic.messages", key), timeout=10)
    assert r.status_code == 405 and error_kind("anthropic.messages", r.json()), r.text
    assert r.headers.get("allow"), r.headers  # the methods that would work, as HTTP says
    r = httpx.get(live.url + "/admin/status", timeout=10)  # the admin API keeps its own (FastAPI) shape
    assert r.status_code == 401 and "detail" in r.json(), r.text
