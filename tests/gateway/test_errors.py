"""Every failure in the caller's own provider shape: auth, bad bodies, size limit, engine failures,
context overflow. Never a stack trace; the SDKs raise their own typed errors."""

import anthropic
import httpx
import openai
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

PROVIDERS = {
    "anthropic.messages": ("/v1/messages", {"model": "claude-x", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}),
    "openai.chat": ("/v1/chat/completions", {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}]}),
    "openai.responses": ("/v1/responses", {"model": "gpt-x", "input": "hi"}),
    "google.generate_content": ("/v1beta/models/gemini-x:generateContent", {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}),
}


def assert_shape(provider: str, r: httpx.Response, status: int) -> str:
    """The error body is the provider's own; returns its message."""
    assert r.status_code == status, r.text
    body = r.json()
    if provider == "anthropic.messages":
        assert body["type"] == "error" and body["error"]["type"], body
        return body["error"]["message"]
    if provider == "google.generate_content":
        assert body["error"]["code"] == status and body["error"]["status"], body
        return body["error"]["message"]
    assert body["error"]["type"] and "message" in body["error"], body
    return body["error"]["message"]


def post(url, provider, key, *, body=None, content=None):
    path, default = PROVIDERS[provider]
    headers = {"content-type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    return httpx.post(url + path, json=default if body is None and content is None else body, content=content,
                      headers=headers, timeout=30)


FIXED = dict(served_model="tiny", max_model_len=4096)  # no start-up discovery against a broken engine


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_forged_or_missing_key_is_a_provider_shaped_401(polar_settings, gateway_factory, dead_port, provider):
    gw = gateway_factory(polar_settings, f"http://127.0.0.1:{dead_port}", **FIXED)
    forged = gw.key("victim").rsplit(".", 1)[0] + ".AAAAAAAAAAAAAAAAAAAAAA"
    assert "signature" in assert_shape(provider, post(gw.url, provider, forged), 401)
    assert "session key" in assert_shape(provider, post(gw.url, provider, ""), 401)
    other_secret = polar_settings.model_copy(update={"session_secret": "not-ours"})
    from schemas.session_keys import mint_session_key

    assert_shape(provider, post(gw.url, provider, mint_session_key("victim", other_secret.session_secret)), 401)
    assert gw.gw.sessions.find("victim") is None  # nothing was created for the forged session


def test_sdks_raise_their_own_auth_errors(polar_settings, gateway_factory, dead_port):
    gw = gateway_factory(polar_settings, f"http://127.0.0.1:{dead_port}", **FIXED)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=gw.url, api_key="sk-ant-bogus", max_retries=0).messages.create(
            model="claude-x", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-bogus", max_retries=0).chat.completions.create(
            model="gpt-x", messages=[{"role": "user", "content": "hi"}])
    google = genai.Client(api_key="bogus", http_options=types.HttpOptions(base_url=gw.url))  # keep it referenced
    with pytest.raises(genai_errors.ClientError) as e:
        google.models.generate_content(model="gemini-x", contents="hi")
    assert e.value.code == 401


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_bad_bodies_are_400_413_in_provider_shape(polar_settings, gateway_factory, dead_port, provider):
    gw = gateway_factory(polar_settings, f"http://127.0.0.1:{dead_port}", max_body_bytes=4096, **FIXED)
    key = gw.key("s-bad")
    assert "not valid JSON" in assert_shape(provider, post(gw.url, provider, key, content=b'{"model": '), 400)
    assert "JSON object" in assert_shape(provider, post(gw.url, provider, key, content=b"[1, 2]"), 400)
    assert_shape(provider, post(gw.url, provider, key, body={"model": "m"}), 400)  # required fields missing
    path, body = PROVIDERS[provider]
    big = {**body, "padding": "x" * 5000}
    assert "limit" in assert_shape(provider, post(gw.url, provider, key, body=big), 413)
    assert gw.gw.sessions.find("s-bad") is None  # refused before any session state exists


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_engine_unreachable_is_502(polar_settings, gateway_factory, dead_port, provider):
    gw = gateway_factory(polar_settings, f"http://127.0.0.1:{dead_port}", **FIXED)
    message = assert_shape(provider, post(gw.url, provider, gw.key("s-502")), 502)
    assert "unreachable" in message
    st = gw.gw.sessions.find("s-502")
    assert (st.next_call_index, st.calls, st.failed) == (1, 1, 1)  # recorded as failed (test_failed_calls.py)


@pytest.mark.parametrize("provider", ["anthropic.messages", "openai.chat"])
def test_engine_timeout_is_504(polar_settings, gateway_factory, silent_port, provider):
    gw = gateway_factory(polar_settings, f"http://127.0.0.1:{silent_port}", upstream_timeout_s=0.5, **FIXED)
    assert "timeout" in assert_shape(provider, post(gw.url, provider, gw.key("s-504")), 504)


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_prompt_over_context_is_the_providers_context_error(polar_settings, gateway_factory, scripted_engine, provider):
    gw = gateway_factory(polar_settings, scripted_engine.url, max_model_len=16)
    message = assert_shape(provider, post(gw.url, provider, gw.key("s-ctx")), 400)
    body = post(gw.url, provider, gw.key("s-ctx")).json()
    if provider.startswith("openai"):
        assert body["error"]["code"] == "context_length_exceeded"  # what LiteLLM-based harnesses look for
    assert "16" in message


def test_openai_sdk_sees_context_length_exceeded(polar_settings, gateway_factory, scripted_engine):
    gw = gateway_factory(polar_settings, scripted_engine.url, max_model_len=16)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.key("s-ctx-sdk"), max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "context_length_exceeded"


def test_engine_rejection_passes_through_with_its_status(polar_settings, gateway_factory, scripted_engine):
    # A misconfigured served-model name: the engine answers 404 (vLLM's shape), the harness gets a 404.
    gw = gateway_factory(polar_settings, scripted_engine.url, served_model="no-such-model", max_model_len=4096)
    message = assert_shape("anthropic.messages", post(gw.url, "anthropic.messages", gw.key("s-404")), 404)
    assert "no-such-model" in message


def test_routes_other_than_calls(polar_settings, gateway_factory, dead_port):
    gw = gateway_factory(polar_settings, f"http://127.0.0.1:{dead_port}", **FIXED)
    assert httpx.head(gw.url + "/gw").status_code == 200  # Claude Code's warm-up, any base path
    assert httpx.get(gw.url + "/health").json()["status"] == "ok"
    assert httpx.get(gw.url + "/gw/v1/models").json()["data"][0]["id"] == "tiny"
    assert httpx.get(gw.url + "/v1/models", headers={"anthropic-version": "2023-06-01"}).json()["data"][0]["type"] == "model"
    assert httpx.get(gw.url + "/v1beta/models").json()["models"][0]["name"] == "models/tiny"
    ws = httpx.get(gw.url + "/v1/responses", headers={"Upgrade": "websocket", "Connection": "Upgrade",
                                                      "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version": "13"})
    assert ws.status_code == 426  # Codex falls back to HTTP at once on exactly this status
    assert httpx.get(gw.url + "/v1/responses").status_code == 405
    assert_shape("openai.chat", httpx.get(gw.url + "/nope"), 404)
