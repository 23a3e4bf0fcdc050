"""Schemathesis against the rollout server's own OpenAPI document (real Kafka behind it).

Positive and negative (schema-violating) cases for every operation: the server must answer each with a
non-5xx status (a 503 is allowed only as its documented ``kafka_unavailable``), and every error in its
own ``{"error": {"code", "message"}}`` shape, never FastAPI's default 422 body or a stack trace.
"""

from __future__ import annotations

import pytest
import schemathesis
from schemathesis import GenerationMode

from infra.settings import Settings
from producers.rollout.server import create_rollout_app

from .strategies import profile

# The document is the app's own (nothing is started to build it); the server under test is a live one.
schema = schemathesis.openapi.from_dict(create_rollout_app(Settings()).openapi())
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                max_examples=max(10, profile().max_examples // 4), deterministic=True)


@pytest.fixture(scope="module")
def rollout_url(infra):
    """One rollout server for the module, on its own topic prefix (each operation is its own test)."""
    import uuid

    from infra.topics import ensure_topics
    from tests.plugins.rollout import start_rollout_server

    settings = infra.settings.model_copy(update={"topic_prefix": f"t{uuid.uuid4().hex[:10]}."})
    ensure_topics(settings)
    server = start_rollout_server(settings)
    yield server.url
    server.stop()


@pytest.mark.timeout(300)
@schema.parametrize()
def test_rollout_api_answers_any_input_in_its_own_shape(case, rollout_url):
    response = case.call(base_url=rollout_url, timeout=60)
    status = response.status_code
    if status >= 400:
        body = response.json()
        assert isinstance(body.get("error"), dict) and body["error"].get("code") and body["error"].get("message"), body
        assert status < 500 or body["error"]["code"] == "kafka_unavailable", (status, body)
