"""What the gateway and rollout fuzzing found, kept as explicit examples, and the limits it led to.

Each example failed before its fix with a 500 (or a misleading 503): RecursionError on deeply nested
tool-call arguments, orjson's 254-level limit when recording a deep tool schema, KeyError/TypeError on a
Gemini ``allowedFunctionNames`` that was not an array, a rollout task that could not be serialized.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from gateway.canonical import ChatRequest, Message, RequestError, Sampling, Tool
from gateway.limits import KeyLimiter, Limits, check_body, check_request, json_depth
from gateway.providers import ADAPTERS
from gateway.providers.arguments import arguments_object, canonical_arguments, normalize_arguments
from gateway.template import to_hf_message

from .client import auth_headers, error_kind

DEEP_TEXT = '{"a":' * 1_100 + "1" + "}" * 1_100  # deeper than Python's json can parse (RecursionError)


def test_deeply_nested_arguments_text_stays_text():
    assert normalize_arguments(DEEP_TEXT) == DEEP_TEXT
    assert canonical_arguments(DEEP_TEXT) == DEEP_TEXT
    assert arguments_object(DEEP_TEXT) == {"_unparsed_arguments": DEEP_TEXT}
    call_msg = ADAPTERS["openai.chat"].parse_request({"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": DEEP_TEXT}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}).messages[1]
    assert to_hf_message(call_msg)["tool_calls"][0]["function"]["arguments"] == DEEP_TEXT


def test_json_depth_counts_without_recursing():
    deep: object = 1
    for _ in range(5_000):
        deep = [deep]
    assert json_depth({"a": [1, {"b": 2}]}, 10) == 3
    assert json_depth(deep, 10) == 11  # stops counting past the limit
    check_body({"tools": [{"input_schema": {"type": "object"}}]}, Limits())
    with pytest.raises(RequestError) as e:
        check_body({"tools": [{"input_schema": deep}]}, Limits())
    assert e.value.status == 400 and "nested deeper" in e.value.message


@pytest.mark.parametrize("allowed", [{"a": 1}, "ab", 5, [1]])
def test_gemini_allowed_function_names_must_be_an_array_of_strings(allowed):
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}],
            "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": allowed}}}
    with pytest.raises(RequestError) as e:
        ADAPTERS["google.generate_content"].parse_request(body, model="m")
    assert e.value.status == 400 and "allowedFunctionNames" in e.value.message
    body["toolConfig"]["functionCallingConfig"]["allowedFunctionNames"] = ["f"]
    assert ADAPTERS["google.generate_content"].parse_request(body, model="m").tool_choice == "f"


def _req(**sampling) -> ChatRequest:
    return ChatRequest("openai.chat", "m", [Message("user", "hi")], sampling=Sampling(**sampling))


@pytest.mark.parametrize("req, field", [
    (ChatRequest("openai.chat", "m", [Message("user", "hi")] * 11), "messages"),
    (ChatRequest("openai.chat", "m", [Message("user", "hi")], tools=[Tool(f"t{i}") for i in range(6)]), "tools"),
    (_req(max_tokens=10**12), "max_tokens"),
    (_req(temperature=-0.5), "temperature"),
    (_req(top_p=1.5), "top_p"),
    (_req(top_k=-7), "top_k"),
    (_req(seed=2**64), "seed"),
    (_req(stop=["x"] * 65), "stop"),
])
def test_request_limits_name_the_field(req, field):
    limits = Limits(max_messages=10, max_tools=5)
    with pytest.raises(RequestError) as e:
        check_request(req, limits)
    assert e.value.status == 400 and e.value.message.startswith(field + ":")
    check_request(_req(max_tokens=100, temperature=0.7, top_p=1.0, top_k=-1, seed=-1), limits)


def test_key_limiter_bounds_sessions_per_key_and_calls_per_session():
    lim = KeyLimiter(Limits(max_sessions_per_key=2, max_inflight_per_session=2, retry_after_s=3))
    with lim.hold("k", "s1"), lim.hold("k", "s1"), lim.hold("k", "s2"):
        with pytest.raises(RequestError) as e:
            with lim.hold("k", "s3"):
                pass
        assert e.value.status == 429 and e.value.headers["Retry-After"] == "3" and "2 sessions" in e.value.message
        with pytest.raises(RequestError, match="calls in flight"):
            with lim.hold("k", "s1"):
                pass
        with lim.hold("other-key", "s3"):  # another key is counted on its own
            assert lim.in_flight() == 4
    assert lim.in_flight() == 0 and not lim._inflight  # everything released, nothing kept per key


# ------------------------------------------------------------------------------------ live gateway

PROVIDER_CALLS = {
    "anthropic.messages": ("/v1/messages", b'{"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}'),
    "openai.chat": ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'),
    "openai.responses": ("/v1/responses", b'{"model": "m", "input": "hi"}'),
    "google.generate_content": ("/v1beta/models/m:generateContent", b'{"contents": [{"parts": [{"text": "hi"}]}]}'),
}


def _raw_post(port: int, path: str, headers: dict[str, str], declared: int, sent: bytes, read: bool) -> bytes:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    s.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {declared}\r\n{head}\r\n".encode() + sent)
    try:
        data = b""
        while read and not _complete(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return data
    finally:
        s.close()


def _complete(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    lengths = [int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")]
    return bool(sep) and bool(lengths) and len(body) >= lengths[0]


@pytest.mark.timeout(180)
def test_stalled_and_vanishing_clients_and_per_key_limits(polar_settings, scripted_engine, gateway_factory):
    from tests.plugins.gateway import read_calls

    limits = Limits(body_timeout_s=1.0, max_sessions_per_key=0)  # every call over the per-key limit
    gw = gateway_factory(polar_settings, scripted_engine.url, max_model_len=4096, limits=limits)
    port = int(gw.url.rsplit(":", 1)[1])
    key = gw.key("fuzz-regress")
    for provider, (path, body) in PROVIDER_CALLS.items():
        headers = {**auth_headers(provider, key), "content-type": "application/json"}
        t0 = time.monotonic()
        stalled = _raw_post(port, path, headers, len(body), body[:10], read=True)  # never finishes its body
        assert stalled.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 20, stalled[:200]
        assert error_kind(provider, httpx.Response(408, content=stalled.split(b"\r\n\r\n", 1)[1]).json()), stalled
        _raw_post(port, path, headers, len(body), body[: len(body) // 2], read=False)  # gone mid-body
        r = httpx.post(gw.url + path, content=body, headers=headers, timeout=30)
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert error_kind(provider, r.json()) in ("rate_limit_error", "RESOURCE_EXHAUSTED"), r.text
    assert httpx.get(gw.url + "/health", timeout=10).json()["status"] == "ok"
    assert read_calls(polar_settings, 0, timeout=3) == []  # nothing refused was recorded


# ------------------------------------------------------------------------------------ rollout API


@pytest.mark.timeout(120)
def test_rollout_refuses_unrecordable_and_duplicate_tasks_before_publishing(rollout_server):
    url = rollout_server.url
    post = lambda raw: httpx.post(f"{url}/tasks", content=raw, headers={"content-type": "application/json"}, timeout=30)  # noqa: E731
    surrogate = post(b'{"task_id": "t1", "instruction": "x\\ud800"}')
    deep = post(b'{"task_id": "t2", "instruction": "x", "metadata": ' + b'{"a":' * 300 + b"1" + b"}" * 300 + b"}")
    twice = httpx.post(f"{url}/tasks", json=[{"task_id": "t3", "instruction": "x"}, {"task_id": "t3", "instruction": "x"}])
    for r, words in ((surrogate, "surrogates"), (deep, "depth"), (twice, "appears twice")):
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_task", r.text
        assert words in r.json()["error"]["message"], r.text
    wrong_method = httpx.put(f"{url}/tasks", timeout=10)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
    assert httpx.get(f"{url}/tasks").json() == []  # nothing was published or remembered
    ok = httpx.post(f"{url}/tasks", json={"task_id": "t1", "instruction": "x", "num_samples": 1, "min_valid": 1}, timeout=30)
    assert ok.status_code == 202, ok.text  # the refused id was not burned
