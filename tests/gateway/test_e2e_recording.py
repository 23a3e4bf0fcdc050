"""End to end: SDK client -> gateway -> real tiny engine (scripted) -> events in the real Kafka.

The central property: the second call's prompt ids are the first call's prompt ids + its sampled ids +
the tokens of what was appended, and that is exactly what the events say once their deltas resolve.
"""

import json

import openai

from schemas import CallRecorded, resolve_prompt
from tests.plugins.gateway import WRITE_FILE, read_calls


def resolve_all(calls: list[CallRecorded]) -> dict[int, list[int]]:
    """call_index -> full prompt ids of one session's calls."""
    full: dict[int, list[int]] = {}
    prompts: dict[int, list[int]] = {}
    for c in sorted(calls, key=lambda c: c.call_index):
        prompts[c.call_index] = resolve_prompt(c, full)
        full[c.call_index] = prompts[c.call_index] + c.completion_ids
    return prompts


def test_chat_two_step_tool_task_is_recorded_token_faithfully(polar_settings, scripted_engine, gateway_factory):
    gw = gateway_factory(polar_settings, scripted_engine.url)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.key("sess-chat", group_id="g1", task_id="t1", sample_index=2))
    messages = [{"role": "system", "content": "You write files."}, {"role": "user", "content": "Create hello.txt containing hi"}]

    first = client.chat.completions.create(model="gpt-whatever", messages=messages, tools=[WRITE_FILE])
    assert first.model == "gpt-whatever"
    (call,) = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, json.loads(call.function.arguments)) == ("write_file", {"path": "hello.txt", "content": "hi"})

    # Echo the call back the way Qwen Code does: arguments re-serialized compactly, keys re-ordered.
    compact = json.dumps({"content": "hi", "path": "hello.txt"}, separators=(",", ":"))
    messages += [{"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function",
                  "function": {"name": "write_file", "arguments": compact}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "wrote 2 bytes"}]
    second = client.chat.completions.create(model="gpt-whatever", messages=messages, tools=[WRITE_FILE])
    assert second.choices[0].message.content == "Done. hello.txt now contains hi."
    assert second.choices[0].finish_reason == "stop"

    calls = read_calls(polar_settings, 2)
    assert [c.call_index for c in calls] == [0, 1]
    c0, c1 = calls
    assert all(isinstance(c, CallRecorded) for c in calls)
    assert (c0.session_id, c0.group_id, c0.task_id, c0.sample_index) == ("sess-chat", "g1", "t1", 2)
    assert (c0.provider, c0.model, c0.served_model) == ("openai.chat", "gpt-whatever", "tiny")
    assert c0.chain.break_reason == "first_call" and c0.prompt_ids is not None
    assert c1.chain.extends_call_index == 0 and c1.chain.break_reason == ""
    assert c1.prompt_delta is not None and c1.prompt_delta.base_call_index == 0
    prompts = resolve_all(calls)
    full0 = prompts[0] + c0.completion_ids
    assert prompts[1][: len(full0)] == full0  # token-in/token-out: nothing sampled was re-tokenized
    assert c1.prompt_delta.base_len == len(full0)
    for c in calls:
        assert len(c.completion_logprobs) == len(c.completion_ids) > 0
        assert all(lp <= 0.0 for lp in c.completion_logprobs)
        assert c.usage.prompt_tokens == len(prompts[c.call_index])
    assert [t.name for t in c0.output.tool_calls] == ["write_file"] and c0.finish_reason == "tool_calls"
    assert c1.output.text == "Done. hello.txt now contains hi." and c1.output.parse_error == ""
    assert c1.request["messages_offset"] == 2  # only what the call added is stored again

    stats = gw.gw.sessions.find("sess-chat").stats()
    assert (stats["num_calls"], stats["merged"], stats["breaks"]) == (2, 1, 0)
