"""Calls answered with an error are recorded too: real gateway, real engine or a broken one, real Kafka.

Each failed call becomes a CallRecorded with ``error`` = "<status> <kind>: <message>", nothing sampled
and ``finish_reason`` "error"; it takes a call_index (so the session's count and the streams include it)
but never becomes a chain tip: the next call extends the last answered one. The streams fold skips it
(no trace, not trained on) and the session still closes once its calls are in.
"""

import httpx
import openai
import pytest

from schemas import SessionEvent, TrainingGroup, decode, encode
from streams.assembly import CallTokens
from streams.config import StreamsConfig
from streams.groups import build_group
from streams.sessions import add_call, add_finished, decide, new_session
from streams.trajectory import build_trajectory
from tests.gateway.test_e2e_recording import WRITE_FILE, resolve_all
from tests.gateway.test_errors import FIXED, PROVIDERS, post
from tests.plugins.gateway import read_calls
from tests.streams.helpers import dedupe, publish, read_topic


def tool_turn(call) -> list[dict]:
    return [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]}]


def overflow_session(gw, sid: str, sample_index: int = 0) -> None:
    """A tool call; then a tool result too big for the context (the harness gets a 400); then a short one."""
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.key(sid, group_id="g", task_id="t", sample_index=sample_index),
                           max_retries=0)
    messages = [{"role": "user", "content": "Create hello.txt containing hi"}]
    first = client.chat.completions.create(model="m", messages=messages, tools=[WRITE_FILE])
    (call,) = first.choices[0].message.tool_calls
    gw.gw.max_model_len = first.usage.prompt_tokens + first.usage.completion_tokens + 80  # room for a short result only
    try:
        messages += tool_turn(call)
        with pytest.raises(openai.BadRequestError) as e:  # a huge tool result: the harness must compact
            client.chat.completions.create(model="m", messages=[*messages, {"role": "tool", "tool_call_id": call.id,
                                                                             "content": "x " * 400}], tools=[WRITE_FILE])
        assert e.value.code == "context_length_exceeded"
        third = client.chat.completions.create(model="m", messages=[*messages, {"role": "tool", "tool_call_id": call.id,
                                                                                 "content": "ok"}], tools=[WRITE_FILE])
        assert third.choices[0].message.content == "Done. hello.txt now contains hi."
    finally:
        gw.gw.max_model_len = None


def test_context_overflow_is_recorded_and_the_next_call_extends_the_last_answered(polar_settings, scripted_engine,
                                                                                   gateway_factory):
    gw = gateway_factory(polar_settings, scripted_engine.url)
    overflow_session(gw, "s-ovf")
    c0, c1, c2 = calls = read_calls(polar_settings, 3, session_id="s-ovf")
    assert [c.call_index for c in calls] == [0, 1, 2]
    assert c0.error == "" and c2.error == ""
    assert c1.error.startswith("400 ") and "context" in c1.error and c1.finish_reason == "error"
    assert c1.completion_ids == [] and c1.completion_logprobs == [] and c1.output.text == ""
    prompts = resolve_all(calls)
    full0 = prompts[0] + c0.completion_ids
    limit = c0.usage.prompt_tokens + c0.usage.completion_tokens + 80
    assert len(prompts[1]) == c1.usage.prompt_tokens > limit  # what was too long, recorded as planned
    assert prompts[1][: len(full0)] == full0 and c1.chain.extends_call_index == 0
    # the failed call is no chain tip and no delta base: call 2 extends call 0, token for token
    assert c2.chain.extends_call_index == 0 and c2.prompt_delta.base_call_index == 0
    assert prompts[2][: len(full0)] == full0 and len(c2.completion_ids) > 0
    st = gw.gw.sessions.find("s-ovf").stats()
    assert (st["num_calls"], st["failed"], st["merged"], st["breaks"]) == (3, 1, 1, 0)

    # The streams: the session closes once its 3 calls are in; the failed call is in no trace.
    finished = SessionEvent(session_id="s-ovf", group_id="g", task_id="t", kind="finished", status="ok", reward=1.0,
                            num_calls=st["num_calls"])
    state = new_session("s-ovf", 0.0, 0)
    assert decide(state, 0.0, StreamsConfig()) == ""
    for c in calls:
        assert add_call(state, c.call_index, c.event_id, 0.0) == "added"
    add_finished(state, finished, 0.0)
    assert decide(state, 0.0, StreamsConfig()) == "assemble"
    tokens = [CallTokens.from_record(c) for c in calls]
    assert CallTokens.from_json(tokens[1].to_json()).error and not CallTokens.from_json(tokens[0].to_json()).error
    merged = build_trajectory(finished, tokens, StreamsConfig(builder="prefix_merging"))
    assert merged.usable and [t.call_indices for t in merged.traces] == [[0, 2]]
    assert merged.stats["dropped_calls"] == 1 and merged.stats["breaks"] == 0
    assert merged.traces[0].token_ids == prompts[2] + c2.completion_ids  # never the over-long prompt
    per_request = build_trajectory(finished, tokens, StreamsConfig(builder="per_request"))
    assert [t.call_indices for t in per_request.traces] == [[0], [2]]


def test_a_session_with_a_failed_call_closes_and_trains_through_the_worker(polar_settings, scripted_engine,
                                                                         gateway_factory, streams_worker):
    gw = gateway_factory(polar_settings, scripted_engine.url)
    overflow_session(gw, "w-s0", 0)
    overflow_session(gw, "w-s1", 1)
    calls = read_calls(polar_settings, 6)
    by_session = {sid: [c for c in calls if c.session_id == sid] for sid in ("w-s0", "w-s1")}
    finished = [SessionEvent(session_id=sid, group_id="g", task_id="t", sample_index=i, num_samples=2, min_valid=2,
                             kind="finished", status="ok", reward=float(i == 0),
                             num_calls=gw.gw.sessions.find(sid).stats()["num_calls"],
                             created_at=max(c.created_at for c in by_session[sid]) + 1)
                for i, sid in enumerate(by_session)]
    assert [f.num_calls for f in finished] == [3, 3]
    publish(polar_settings, finished)
    streams_worker("--builder", "prefix_merging", "--tick-interval", "0.5")
    got, _ = dedupe(read_topic(polar_settings, "groups", until=lambda m: len(m) >= 1, timeout=90, idle=1.0), TrainingGroup)
    (raw,) = got.values()
    group = decode(raw, TrainingGroup)
    assert group.masked == [] and len(group.trajectories) == 2  # all calls in: no missing-calls wait, no mask
    for traj in group.trajectories:
        assert [t.call_indices for t in traj.traces] == [[0, 2]] and traj.stats["dropped_calls"] == 1
        assert traj.stats["missing_calls"] == 0 and traj.usable
    cfg = StreamsConfig(builder="prefix_merging")
    trajs = [build_trajectory(f, [CallTokens.from_record(c) for c in by_session[f.session_id]], cfg) for f in finished]
    assert raw == encode(build_group("g", trajs, cfg), packed=True)  # the worker = the pure functions, byte for byte


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_engine_unreachable_502_is_recorded(polar_settings, gateway_factory, dead_port, provider):
    gw = gateway_factory(polar_settings, f"http://127.0.0.1:{dead_port}", **FIXED)
    sid = f"s-502-{provider}"
    assert post(gw.url, provider, gw.key(sid, harness="probe")).status_code == 502
    assert post(gw.url, provider, gw.key(sid, harness="probe")).status_code == 502  # the harness retries
    c0, c1 = read_calls(polar_settings, 2, session_id=sid)
    assert (c0.call_index, c1.call_index) == (0, 1)
    for c in (c0, c1):
        assert c.error.startswith("502 ") and "unreachable" in c.error
        assert (c.provider, c.harness, c.finish_reason, c.completion_ids) == (provider, "probe", "error", [])
    assert c0.prompt_ids and c0.chain.break_reason == "first_call"
    assert c1.chain.break_reason == "first_call"  # still no answered call to extend
    st = gw.gw.sessions.find(sid)
    assert (st.next_call_index, st.calls, st.failed) == (2, 2, 2)


def test_engine_timeout_504_is_recorded(polar_settings, gateway_factory, silent_port):
    gw = gateway_factory(polar_settings, f"http://127.0.0.1:{silent_port}", upstream_timeout_s=0.5, **FIXED)
    assert post(gw.url, "anthropic.messages", gw.key("s-504")).status_code == 504
    (c,) = read_calls(polar_settings, 1, session_id="s-504")
    assert c.error.startswith("504 timeout_error") and c.finish_reason == "error" and c.completion_ids == []
    assert c.timings.total_ms >= 400  # it waited for the engine before giving up


def test_unparseable_tool_markup_is_answered_as_text_and_flagged(polar_settings, gateway_factory, engine_server_factory,
                                                                 tmp_path):
    script = tmp_path / "bad.yaml"
    script.write_text('turns:\n  - raw: "<tool_call>\\n{\\"name\\": \\"write_file\\", \\"arguments\\": {oops}\\n</tool_call>"\n')
    engine = engine_server_factory(script=script)
    gw = gateway_factory(polar_settings, engine.url)
    r = httpx.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {gw.key('s-markup')}"},
                   json={"model": "m", "messages": [{"role": "user", "content": "go"}], "tools": [WRITE_FILE]}, timeout=60)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert "<tool_call>" in msg["content"] and not msg.get("tool_calls")
    (c,) = read_calls(polar_settings, 1, session_id="s-markup")
    assert c.error == "" and c.output.parse_error and "<tool_call>" in c.output.text
    assert len(c.completion_ids) == len(c.completion_logprobs) > 0  # sampled: a real (bad) action, trainable
