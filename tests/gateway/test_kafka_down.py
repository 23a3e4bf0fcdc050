"""Kafka goes down mid-run: harnesses get prompt provider-shaped 503s (never a hang), nothing is
half-recorded, and once the broker is back every answered call is in the topic."""

import time

import httpx

from tests.plugins.gateway import read_calls

USER = [{"role": "system", "content": "You write files."}, {"role": "user", "content": "Create hello.txt containing hi"}]
TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {}}}}]


def chat(gw, sid, messages, timeout=120):
    t0 = time.monotonic()
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "gpt-x", "messages": messages, "tools": TOOLS}, timeout=timeout,
                   headers={"Authorization": f"Bearer {gw.key(sid)}"})
    return r, time.monotonic() - t0


def test_broker_down_gives_503s_and_loses_no_answered_call(infra, polar_settings, scripted_engine, gateway_factory):
    gw = gateway_factory(polar_settings, scripted_engine.url, publish_timeout_s=2.0, retry_after_s=1)
    answered: set[tuple[str, int]] = set()

    r, _ = chat(gw, "A", USER)
    assert r.status_code == 200
    answered.add(("A", 0))
    turn2 = USER + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or "",
                     "tool_calls": r.json()["choices"][0]["message"].get("tool_calls")},
                    {"role": "tool", "tool_call_id": r.json()["choices"][0]["message"]["tool_calls"][0]["id"], "content": "ok"}]

    infra.kafka.stop()
    try:
        r, took = chat(gw, "A", turn2)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert took < 2.0 + 30  # the publish wait, plus one engine call on a loaded machine
        assert r.json()["error"]["type"], r.text  # OpenAI's error shape
        r, took = chat(gw, "B", USER)  # another session: refused before touching the engine
        assert r.status_code == 503 and took < 2.0, (r.status_code, took)
        r, took = chat(gw, "A", turn2)  # the harness retries: still refused, at once
        assert r.status_code == 503 and took < 2.0
        assert gw.gw.sessions.find("B").stats()["num_calls"] == 0
    finally:
        infra.kafka.start()

    deadline = time.monotonic() + 90
    while True:  # the gateway recovers by itself once the pending publish is resolved
        r, _ = chat(gw, "B", USER)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert r.status_code == 200, r.text
    answered.add(("B", gw.gw.sessions.find("B").stats()["num_calls"] - 1))
    r, _ = chat(gw, "A", turn2)
    assert r.status_code == 200, r.text
    a = gw.gw.sessions.find("A").stats()
    answered.add(("A", a["num_calls"] - 1))

    calls = read_calls(polar_settings, a["num_calls"] + 1)
    keys = [(c.session_id, c.call_index) for c in calls]
    assert len(keys) == len(set(keys))  # nothing recorded twice
    assert answered <= set(keys)  # every answered call is in the topic
    a_calls = [c for c in calls if c.session_id == "A"]
    assert [c.call_index for c in a_calls] == list(range(a["num_calls"]))  # no gaps: state matches the topic
    if len(a_calls) == 3:  # the unanswered call did land after all: the harness's retry repeats it
        assert a_calls[2].chain.break_reason == "retry"
    else:
        assert a_calls[1].chain.extends_call_index == 0
