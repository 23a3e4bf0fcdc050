"""Sessions through the running gateway: side calls, serialization, pause/resume, admin, open mode."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gateway.server import ThreadedServer
from tests.plugins.gateway import read_calls, slow_front

TOOLS = [{"name": "write_file", "description": "Write a file", "input_schema": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}]
SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.2bb; cc_entrypoint=sdk-cli;"},
          {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}}]


def messages_call(url, key, messages, **extra):
    body = {"model": "claude-opus-4-8", "max_tokens": 256, "system": SYSTEM, "messages": messages, "tools": TOOLS, **extra}
    r = httpx.post(url + "/v1/messages?beta=true", json=body, timeout=120,
                   headers={"x-api-key": key, "anthropic-version": "2023-06-01", "user-agent": "claude-cli/2.1.197 (external, sdk-cli)"})
    assert r.status_code == 200, r.text
    return r.json()


def admin(gw, method, path, **kw):
    return httpx.request(method, gw.url + path, headers={"Authorization": f"Bearer {gw.settings.admin_token}"}, timeout=60, **kw)


def test_side_call_between_turns_leaves_the_main_chain_intact(polar_settings, scripted_engine, gateway_factory):
    gw = gateway_factory(polar_settings, scripted_engine.url)
    key = gw.key("cc-1")
    history = [{"role": "user", "content": [{"type": "text", "text": "Create hello.txt containing hi"}]}]
    first = messages_call(gw.url, key, history)
    (use,) = [b for b in first["content"] if b["type"] == "tool_use"]
    # Claude Code's title request: JSON output, no tools (the adapter marks it a side call).
    title = messages_call(gw.url, key, [{"role": "user", "content": "Write a title for: Create hello.txt"}], tools=[],
                          output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}})
    assert title["content"][0]["text"] == '{"title": "Hello file"}'
    history += [{"role": "assistant", "content": [use]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "ok"}]}]
    messages_call(gw.url, key, history)

    c0, c1, c2 = read_calls(polar_settings, 3, session_id="cc-1")
    assert (c1.side_call, c1.chain.break_reason, c1.chain.extends_call_index) == (True, "side_call", None)
    assert (c2.side_call, c2.chain.extends_call_index, c2.chain.break_reason) == (False, 0, "")
    assert c2.prompt_delta.base_call_index == 0  # built on the main chain, not on the side call
    assert {c.harness for c in (c0, c1, c2)} == {"claude_code"}  # told by User-Agent
    assert "cc_version" not in str(c0.request["messages"])  # billing line stripped from the system prompt
    stats = admin(gw, "GET", "/admin/sessions/cc-1").json()
    assert (stats["num_calls"], stats["merged"], stats["side_calls"], stats["breaks"]) == (3, 1, 1, 0)


def test_a_call_to_another_model_is_a_side_call_even_when_it_extends_the_history(polar_settings, scripted_engine,
                                                                                 gateway_factory):
    # A summary request to a small model that no adapter marker knows: it carries the whole history, so
    # as the chain tip it would make the next main call look like a break (not_prefix).
    gw = gateway_factory(polar_settings, scripted_engine.url)
    key = gw.key("cc-2")
    history = [{"role": "user", "content": [{"type": "text", "text": "Create hello.txt containing hi"}]}]
    first = messages_call(gw.url, key, history)
    (use,) = [b for b in first["content"] if b["type"] == "tool_use"]
    history += [{"role": "assistant", "content": [use]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "ok"}]}]
    messages_call(gw.url, key, history, model="claude-haiku-4-5")  # same history and tools, another model
    messages_call(gw.url, key, [*history, {"role": "user", "content": "summarize"}], tools=[])  # no tools
    messages_call(gw.url, key, history)
    c0, c1, c2, c3 = read_calls(polar_settings, 4, session_id="cc-2")
    assert (c1.side_call, c2.side_call, c3.side_call) == (True, True, False)
    assert (c3.chain.extends_call_index, c3.chain.break_reason) == (0, "")  # the main chain went on


def test_a_sub_agent_and_the_main_loop_each_keep_merging_their_own_chain(polar_settings, scripted_engine,
                                                                         gateway_factory):
    # Claude Code's Task: the sub-agent shares the session key but has its own system prompt and tools.
    # With one tip per session every switch broke both chains; keyed tips let each extend its own.
    gw = gateway_factory(polar_settings, scripted_engine.url)
    key = gw.key("cc-task")
    agent_system = [{"type": "text", "text": "You are a sub-agent: do the one task you are given."}]

    def turn(history, **extra):
        answer = messages_call(gw.url, key, history, **extra)
        (use,) = [b for b in answer["content"] if b["type"] == "tool_use"]
        return [*history, {"role": "assistant", "content": [use]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "ok"}]}]

    main = turn([{"role": "user", "content": [{"type": "text", "text": "Create hello.txt containing hi"}]}])  # 0
    sub = turn([{"role": "user", "content": "Create hello.txt containing hi"}], system=agent_system)  # 1: starts
    messages_call(gw.url, key, sub, system=agent_system)  # 2: the sub-agent goes on
    messages_call(gw.url, key, main)  # 3: the main loop goes on after the Task's result
    calls = sorted(read_calls(polar_settings, 4, session_id="cc-task"), key=lambda c: c.call_index)
    assert [(c.chain.extends_call_index, c.chain.break_reason) for c in calls] == [
        (None, "first_call"), (None, "system_changed"), (1, ""), (0, "")]
    assert calls[3].prompt_delta.base_call_index == 0  # encoded against its own chain's tip


def test_parallel_sub_agent_and_main_calls_overlap_and_both_chains_merge(polar_settings, scripted_engine,
                                                                         gateway_factory):
    # Claude Code runs Task sub-agents while the main loop waits on them, and several Tasks at once:
    # calls of different chains must not queue behind each other (one lock per chain, not per session),
    # and each still extends its own chain. call_index is assigned at publish: 0..n-1, no holes.
    delay = 1.5
    with ThreadedServer(slow_front(scripted_engine.url, delay)) as up:
        gw = gateway_factory(polar_settings, up.url)
        key = gw.key("cc-par")
        # two sub-agents of one kind (same system prompt and tools) differ only in the task they were given
        agent = [{"type": "text", "text": "You are a sub-agent: do the one task you are given."}]

        def turn(history, system):
            answer = messages_call(gw.url, key, history, system=system)
            (use,) = [b for b in answer["content"] if b["type"] == "tool_use"]
            return [*history, {"role": "assistant", "content": [use]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "ok"}]}]

        firsts = [[{"role": "user", "content": [{"type": "text", "text": f"Create {name}.txt containing hi"}]}]
                  for name in ("hello", "a", "b")]
        systems = [SYSTEM, agent, agent]
        with ThreadPoolExecutor(3) as pool:
            started = time.perf_counter()
            histories = list(pool.map(turn, firsts, systems))  # three chains start together
            list(pool.map(lambda h, system: messages_call(gw.url, key, h, system=system), histories,
                          systems))  # and each goes on
            wall = time.perf_counter() - started
    calls = sorted(read_calls(polar_settings, 6, session_id="cc-par"), key=lambda c: c.call_index)
    assert [c.call_index for c in calls] == list(range(6))
    # in flight at once: every call of a round overlaps the others (serialized, a round takes 3 x delay)
    spans = [(c.timings.received_at, c.timings.received_at + c.timings.total_ms / 1000) for c in calls]
    assert max(s for s, _ in spans[:3]) < min(e for _, e in spans[:3]), spans
    # two rounds of three calls (2 x delay), not six one after another (6 x delay); the margin is for a
    # loaded machine (6.1 s was seen with test workers sharing 2 cores)
    assert wall < 5 * delay, wall
    # the first round starts three chains; each call of the second extends its own chain's call
    # (each planned before any chain had a tip: all three are first calls)
    assert [(c.chain.extends_call_index, c.chain.break_reason) for c in calls[:3]] == [(None, "first_call")] * 3
    assert sorted(c.chain.extends_call_index for c in calls[3:]) == [0, 1, 2]
    for c in calls[3:]:
        base = calls[c.chain.extends_call_index]
        assert c.chain.break_reason == "" and c.prompt_delta.base_call_index == base.call_index


def test_concurrent_calls_of_one_session_are_serialized(polar_settings, scripted_engine, gateway_factory):
    gw = gateway_factory(polar_settings, scripted_engine.url)
    key = gw.key("par")
    msgs = [{"role": "user", "content": "Create hello.txt containing hi"}]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: messages_call(gw.url, key, msgs), range(4)))
    calls = read_calls(polar_settings, 4, session_id="par")
    assert [c.call_index for c in calls] == [0, 1, 2, 3]
    assert [c.chain.break_reason for c in calls] == ["first_call", "retry", "retry", "retry"]
    # The repeats reuse the first prompt token for token (stored as an empty-suffix delta).
    assert all(c.prompt_delta.base_len == c0 and not c.prompt_delta.suffix_ids
               for c, c0 in [(c, len(calls[0].prompt_ids)) for c in calls[1:]])


def test_pause_holds_calls_until_resume(polar_settings, scripted_engine, gateway_factory):
    gw = gateway_factory(polar_settings, scripted_engine.url)
    assert httpx.post(gw.url + "/admin/pause").status_code == 401  # the admin token is required
    paused = admin(gw, "POST", "/admin/pause", params={"timeout_s": 5})
    assert paused.json()["paused"] is True and paused.json()["drained"] is True
    done = threading.Event()
    worker = threading.Thread(target=lambda: (messages_call(gw.url, gw.key("held"), [{"role": "user", "content": "hi"}]), done.set()))
    worker.start()
    time.sleep(1.5)
    assert not done.is_set()  # held, not refused
    assert admin(gw, "GET", "/admin/status").json()["paused"] is True
    assert admin(gw, "POST", "/admin/policy_version", json={"version": 7}).json() == {"version": 7}
    admin(gw, "POST", "/admin/resume")
    worker.join(timeout=120)
    assert done.is_set()
    assert admin(gw, "GET", "/admin/policy_version").json() == {"version": 7}
    assert read_calls(polar_settings, 1, session_id="held")[0].call_index == 0


def test_pause_reports_undrained_calls(polar_settings, silent_port_gateway):
    gw = silent_port_gateway
    worker = threading.Thread(target=lambda: httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}]}, headers={"Authorization": f"Bearer {gw.key('slow')}"}))
    worker.start()
    time.sleep(0.5)  # the call is now waiting on the engine
    r = admin(gw, "POST", "/admin/pause", params={"timeout_s": 0.3}).json()
    assert (r["drained"], r["in_flight"]) == (False, 1)
    admin(gw, "POST", "/admin/resume")
    worker.join()


@pytest.fixture
def silent_port_gateway(polar_settings, gateway_factory, silent_port):
    return gateway_factory(polar_settings, f"http://127.0.0.1:{silent_port}", served_model="tiny", max_model_len=4096,
                           upstream_timeout_s=3)


def test_admin_mints_keys_and_reports_sessions(polar_settings, scripted_engine, gateway_factory):
    gw = gateway_factory(polar_settings, scripted_engine.url)
    minted = admin(gw, "POST", "/admin/sessions", json={"session_id": "node-7", "group_id": "g", "task_id": "t",
                                                       "sample_index": 1, "harness": "codex"}).json()
    assert admin(gw, "GET", "/admin/sessions/node-7").json()["known"] is False
    messages_call(gw.url, minted["session_key"], [{"role": "user", "content": "hi"}])
    (call,) = read_calls(polar_settings, 1, session_id="node-7")
    assert (call.group_id, call.task_id, call.sample_index, call.harness) == ("g", "t", 1, "codex")
    assert admin(gw, "DELETE", "/admin/sessions/node-7").json()["num_calls"] == 1
    assert admin(gw, "GET", "/admin/sessions/node-7").json()["known"] is False
    late = httpx.post(gw.url + "/v1/messages", headers={"x-api-key": minted["session_key"]}, timeout=60,
                      json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "again"}]})
    assert late.status_code == 401 and late.json()["error"]["type"] == "authentication_error"  # closed: no call 0 again
    assert "closed" in late.json()["error"]["message"]
    assert admin(gw, "POST", "/admin/sessions", json={"session_id": ""}).status_code == 422


def test_a_restarted_gateway_keeps_closed_sessions_closed_and_never_reuses_a_call_index(
        polar_settings, scripted_engine, gateway_factory, tmp_path):
    tombstones = str(tmp_path / "tombstones.jsonl")
    first = gateway_factory(polar_settings, scripted_engine.url, tombstones=tombstones)
    done, going_on = first.key("done-1"), first.key("going-on-1")
    msgs = [{"role": "user", "content": "hi"}]
    messages_call(first.url, done, msgs)
    messages_call(first.url, going_on, msgs)
    assert admin(first, "DELETE", "/admin/sessions/done-1").status_code == 200
    first.stop()  # the process is gone, and every session state with it
    again = gateway_factory(polar_settings, scripted_engine.url, tombstones=tombstones)
    late = httpx.post(again.url + "/v1/messages", headers={"x-api-key": done}, timeout=60,
                      json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "again"}]})
    assert late.status_code == 401 and "closed" in late.json()["error"]["message"]
    messages_call(again.url, going_on, msgs)  # its key predates this process: numbered from the boot base
    c0, c1 = read_calls(polar_settings, 2, session_id="going-on-1")
    assert (c0.call_index, c0.boot_id) == (0, first.gw.sessions.boot_id)
    assert (c1.call_index, c1.boot_id) == (again.gw.sessions.boot_base, again.gw.sessions.boot_id)
    assert c1.call_index > c0.call_index and c1.boot_id != c0.boot_id


def test_open_mode_records_ad_hoc_sessions(polar_settings, scripted_engine, gateway_factory):
    gw = gateway_factory(polar_settings, scripted_engine.url, open_mode=True, publish_mode="async")
    msgs = [{"role": "user", "content": "hi"}]
    messages_call(gw.url, "sk-my-own-key", msgs)
    messages_call(gw.url, "sk-another-key", msgs)
    r = httpx.post(gw.url + "/s/my-run/v1/chat/completions", json={"model": "m", "messages": msgs}, timeout=120)
    assert r.status_code == 200
    # No tools offered: the model's tool-call markup is its text, as vLLM answers without tools.
    assert "<tool_call>" in r.json()["choices"][0]["message"]["content"]
    assert not r.json()["choices"][0]["message"].get("tool_calls")
    calls = read_calls(polar_settings, 3)
    sessions = {c.session_id for c in calls}
    assert len(sessions) == 3 and "open:my-run" in sessions
    assert all(s.startswith("open:") for s in sessions)  # never a rollout session's id


def test_shed_session_continues_its_call_indexes(polar_settings, scripted_engine, gateway_factory):
    gw = gateway_factory(polar_settings, scripted_engine.url, max_sessions=1)
    msgs = [{"role": "user", "content": "Create hello.txt containing hi"}]
    first = messages_call(gw.url, gw.key("A"), msgs)
    messages_call(gw.url, gw.key("B"), msgs)  # A's chain tip is shed to stay within max_sessions
    (use,) = [b for b in first["content"] if b["type"] == "tool_use"]
    messages_call(gw.url, gw.key("A"), msgs + [{"role": "assistant", "content": [use]}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use["id"], "content": "ok"}]}])
    a0, a1 = read_calls(polar_settings, 2, session_id="A")
    assert (a1.call_index, a1.chain.break_reason, a1.chain.extends_call_index) == (1, "state_evicted", None)


def test_a_secret_the_model_wrote_itself_does_not_break_the_chain(polar_settings, scripted_engine, gateway_factory):
    # The harness echoes the model's turn; the gateway scrubs the echo on the way in. The chain tip must
    # hold the turn as scrubbed too, or the echo never matches and every such session breaks here.
    secret = "sk-proj-ABCDEFGHIJKLMNOPQRSTUVWX1234"  # what TOOL_SCRIPT answers to "leak the key"
    gw = gateway_factory(polar_settings, scripted_engine.url)
    key = gw.key("leaky")
    first = [{"role": "user", "content": "leak the key"}]

    def chat(messages):
        r = httpx.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=120,
                       json={"model": "m", "messages": messages})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    answer = chat(first)
    assert secret in answer  # the harness gets the model's answer unchanged
    chat([*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "thanks"}])
    calls = sorted(read_calls(polar_settings, 2, session_id="leaky"), key=lambda c: c.call_index)
    assert secret not in calls[0].output.text and calls[0].redactions == {"output.openai_key": 1}
    assert calls[1].chain.extends_call_index == 0 and calls[1].chain.break_reason == ""  # merged, not broken
