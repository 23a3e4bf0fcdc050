"""A real CLI's captured shape: conversations built from it, its reward rule, and the capture's parsing."""

from __future__ import annotations

import json

import pytest

from polarstream.demo.capture import _shape
from polarstream.demo.shape import CAPTURE_CONTENT, CAPTURE_QUESTION, Shape
from polarstream.driver.processes import ProcessFailed
from schemas import CallRecorded, PromptDelta

SYSTEM = "You are pi.\nCurrent working directory: /workspace"
TOOLS = [{"name": "write", "description": "Write a file.", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path", "content"]}}]


def _msg(role, content="", **kw):
    return {"role": role, "content": content, "tool_calls": [], "tool_call_id": "", "name": "", "reasoning": "",
            "is_error": False, **kw}


def _captured_calls() -> list[CallRecorded]:
    task = "Compute 4 + 3 and write only the result to answer.txt using the write tool."
    first = [_msg("system", SYSTEM), _msg("user", f"<context>repo</context>\n{task}")]
    call = {"id": "toolu_1", "name": "write", "arguments": json.dumps({"path": "answer.txt", "content": CAPTURE_CONTENT})}
    after = [_msg("assistant", "", tool_calls=[call]),
             _msg("tool", f"Successfully wrote {len(CAPTURE_CONTENT)} bytes to answer.txt", tool_call_id="toolu_1", name="write")]
    common = {"session_id": "s", "task_id": "t", "provider": "anthropic.messages", "completion_ids": [5], "completion_logprobs": [-0.1]}
    return [CallRecorded(call_index=0, request={"messages": first, "tools": TOOLS}, prompt_ids=[1, 2], **common),
            CallRecorded(call_index=1, request={"messages_offset": 2, "messages": after, "tools_as_call": 0},
                         prompt_delta=PromptDelta(base_call_index=0, base_len=3, suffix_ids=[7]), **common)]


def test_capture_records_become_a_shape_whose_conversations_swap_in_the_problem():
    shape = _shape("pi", "anthropic", "0.73.1", _captured_calls(), logs=None)
    assert [m["role"] for m in shape.first] == ["system", "user"] and shape.write_call_id == "toolu_1"
    convo = shape.conversation("2 + 9", "11")
    assert [m["role"] for m in convo] == ["system", "user", "assistant", "tool", "assistant"]
    assert convo[0]["content"] == SYSTEM  # the CLI's own system prompt, untouched
    # the task as the CLI framed it, with this problem
    assert convo[1]["content"] == "<context>repo</context>\nCompute 2 + 9 and write only the result to answer.txt using the write tool."
    assert CAPTURE_QUESTION not in json.dumps(convo) and CAPTURE_CONTENT not in json.dumps(convo)
    call = convo[2]["tool_calls"][0]["function"]
    assert call["name"] == "write" and json.loads(call["arguments"]) == {"path": "answer.txt", "content": "11"}
    assert convo[3]["content"] == "Successfully wrote 2 bytes to answer.txt"  # the CLI's result, for this content
    assert convo[4] == {"role": "assistant", "content": "Done."}
    prose = shape.conversation("2 + 9", "11", use_tool=False)
    assert prose[-1] == {"role": "assistant", "content": "2 + 9 = 11."} and len(prose) == 3
    assert Shape.from_json(json.loads(json.dumps(shape.to_json()))) == shape


def test_a_capture_without_the_write_result_is_refused():
    calls = _captured_calls()
    with pytest.raises(ProcessFailed, match="expected a call that writes answer.txt, then one after its result"):
        _shape("pi", "anthropic", "0.73.1", calls[:1], logs=None)
    calls[1].request["messages"] = calls[1].request["messages"][1:]  # a tool result without the write call
    with pytest.raises(ProcessFailed, match="did not carry the write call's result"):
        _shape("pi", "anthropic", "0.73.1", calls, logs=None)


def test_a_cli_that_re_sends_its_first_request_is_captured_from_the_call_after_the_result():
    first, after = _captured_calls()
    retry = first.model_copy(update={"call_index": 1})  # Gemini CLI sent its first request twice
    after = after.model_copy(update={"call_index": 2})
    assert _shape("gemini_cli", "google", "0.1", [first, retry, after], logs=None).write_call_id == "toolu_1"


@pytest.mark.parametrize("text,expected", [
    ('7 + 4 = 11.\n<tool_call>\n{"name": "write", "arguments": {"path": "answer.txt", "content": "11"}}\n</tool_call>', 1.0),
    ('<tool_call>\n{"name": "write", "arguments": {"path": "./answer.txt", "content": " 11"}}\n</tool_call>', 1.0),
    ('<tool_call>\n{"name": "write", "arguments": {"path": "answer.txt", "content": "12"}}\n</tool_call>', 0.0),
    ('<tool_call>\n{"name": "write_file", "arguments": {"path": "answer.txt", "content": "11"}}\n</tool_call>', 0.0),
    ('<tool_call>\n{"name": "write", "arguments": {"path": "notes.txt", "content": "11"}}\n</tool_call>', 0.0),
    ("7 + 4 = 11.", 0.0),
])
def test_reward_needs_the_clis_own_tool_on_answer_txt_with_the_answer(text, expected):
    shape = _shape("pi", "anthropic", "0.73.1", _captured_calls(), logs=None)
    assert shape.reward(text, "11") == expected


def test_the_built_in_demo_keeps_its_write_file_instruction():
    from polarstream.demo import arith

    assert arith.instruction("1 + 2").endswith("using the write_file tool.")
    assert arith.task_request("1 + 2", "3", task_id="t", num_samples=2, harness={"name": "pi"},
                                   tool="write").instruction.endswith("using the write tool.")


@pytest.mark.parametrize("args,message", [
    (["--harness", "codex"], "demo: --harness codex: expected builtin or one of claude_code, gemini_cli, opencode, pi, qwen_code"),
    (["--harness", "pi", "--api", "grpc"], "demo: --api grpc: pi speaks anthropic, chat, responses or google here"),
    (["--harness", "qwen_code", "--api", "google"], "demo: --api google: qwen_code speaks chat here"),
])
def test_demo_refuses_a_harness_or_api_it_cannot_run_in_one_line(args, message):
    from typer.testing import CliRunner

    from polarstream.cli import app

    result = CliRunner().invoke(app, ["demo", *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_each_cli_runs_over_its_own_api_and_only_pi_is_capped():
    from polarstream.demo.shape import APIS, harness_config

    assert harness_config("pi", "responses") == {"api": "responses", "max_tokens": 48}
    assert harness_config("opencode", "anthropic") == {"api": "anthropic"}
    assert harness_config("qwen_code", "chat") == {}  # one API: the CLI's adapter takes no api option
    assert all(APIS[h][0] == d for h, d in {"pi": "anthropic", "qwen_code": "chat", "gemini_cli": "google",
                                             "claude_code": "anthropic"}.items())
