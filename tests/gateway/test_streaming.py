"""Streaming answers: one body when the call is quick, a kept-alive stream when it is not, and Google's
``streamGenerateContent`` as a JSON array without ``alt=sse`` (as Google answers)."""


import httpx
import orjson
import pytest

import gateway.routes as routes
from gateway.server import ThreadedServer
from tests.plugins.gateway import read_calls, slow_front

ASK = {"model": "claude-x", "max_tokens": 16, "stream": True, "messages": [{"role": "user", "content": "Create hello.txt"}]}


@pytest.fixture
def short_keepalive(monkeypatch):
    monkeypatch.setattr(routes, "KEEPALIVE_AFTER_S", 0.2)
    monkeypatch.setattr(routes, "KEEPALIVE_EVERY_S", 0.25)


def _post(gw, sid: str, path: str = "/v1/messages", body: dict = ASK) -> httpx.Response:
    return httpx.post(gw.url + path, json=body, headers={"x-api-key": gw.key(sid)}, timeout=60)


def test_a_slow_call_gets_its_200_and_keepalive_comments_then_the_answer(polar_settings, scripted_engine, gateway_factory,
                                                                        short_keepalive):
    with ThreadedServer(slow_front(scripted_engine.url, 1.0)) as up:
        gw = gateway_factory(polar_settings, up.url)
        r = _post(gw, "slow")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    head, _, rest = r.text.partition("event: message_start")
    assert head.startswith("event: ping\n") and head.count("event: ping") >= 3  # Anthropic's own keep-alive
    assert "event: message_stop" in rest  # the whole answer follows the comments
    (call,) = read_calls(polar_settings, 1, session_id="slow")
    assert call.completion_ids and not call.error


def test_a_failure_after_the_200_arrives_as_the_providers_stream_error(polar_settings, scripted_engine, gateway_factory,
                                                                      short_keepalive):
    with ThreadedServer(slow_front(scripted_engine.url, 0.8, fail=True)) as up:
        gw = gateway_factory(polar_settings, up.url)
        r = _post(gw, "slow-fail")
    assert r.status_code == 200 and r.text.startswith("event: ping\n")
    (event,) = [e for e in r.text.split("\n\n") if e.startswith("event: error\n")]
    err = orjson.loads(event.partition("data: ")[2])
    assert err["type"] == "error" and "engine fell over" in err["error"]["message"]
    (call,) = read_calls(polar_settings, 1, session_id="slow-fail")
    assert call.error.startswith("500")  # recorded before the harness saw it


def test_a_quick_call_is_one_body_with_a_length_and_google_without_alt_sse_is_a_json_array(
        polar_settings, scripted_engine, gateway_factory):
    gw = gateway_factory(polar_settings, scripted_engine.url)
    r = _post(gw, "quick")
    assert r.status_code == 200 and int(r.headers["content-length"]) == len(r.content) and "event: ping" not in r.text[:40]
    google = {"contents": [{"role": "user", "parts": [{"text": "Create hello.txt"}]}]}
    path = "/v1beta/models/gemini-x:streamGenerateContent"
    arr = _post(gw, "g-json", path, google)
    assert arr.status_code == 200 and arr.headers["content-type"] == "application/json"
    chunks = arr.json()
    assert isinstance(chunks, list) and chunks and all("candidates" in c for c in chunks)
    assert chunks[-1]["candidates"][0].get("finishReason")
    sse = _post(gw, "g-sse", path + "?alt=sse", google)
    assert sse.headers["content-type"].startswith("text/event-stream") and sse.text.startswith("data: ")
