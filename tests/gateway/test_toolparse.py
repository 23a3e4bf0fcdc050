"""Tool-call and reasoning parsing of raw completion text."""

import json

from gateway.canonical import Tool
from gateway.toolparse import Parsers, parse_tool_calls, split_reasoning

SHELL = Tool(
    name="shell",
    parameters={"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"},
                                                  "env": {"type": "object"}, "background": {"type": "boolean"}}},
)


def test_hermes_single_call_with_leading_text():
    out = parse_tool_calls('Let me look.\n<tool_call>\n{"name": "shell", "arguments": {"command": "ls -la"}}\n</tool_call>')
    assert out.text == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("shell", {"command": "ls -la"})]
    assert out.parse_error == ""
    assert out.tool_calls[0].id.startswith("call_")


def test_hermes_parallel_calls_get_distinct_ids():
    text = "".join(f'<tool_call>{{"name": "shell", "arguments": {{"command": "echo {i}"}}}}</tool_call>\n' for i in range(3))
    out = parse_tool_calls(text)
    assert [json.loads(c.arguments)["command"] for c in out.tool_calls] == ["echo 0", "echo 1", "echo 2"]
    assert len({c.id for c in out.tool_calls}) == 3
    assert out.text == ""


def test_hermes_arguments_given_as_json_string():
    out = parse_tool_calls('<tool_call>{"name": "shell", "arguments": "{\\"command\\": \\"pwd\\"}"}</tool_call>')
    assert json.loads(out.tool_calls[0].arguments) == {"command": "pwd"}


def test_invalid_json_stays_text_and_is_flagged():
    raw = 'ok <tool_call>{"name": "shell", "arguments": {"command": }</tool_call>'
    out = parse_tool_calls(raw)
    assert out.tool_calls == []
    assert out.text == raw
    assert "not valid JSON" in out.parse_error


def test_bad_block_flagged_while_good_block_parses():
    raw = '<tool_call>{"nam": 1}</tool_call>\n<tool_call>{"name": "shell", "arguments": {}}</tool_call>'
    out = parse_tool_calls(raw)
    assert [c.name for c in out.tool_calls] == ["shell"]
    assert '{"nam": 1}' in out.text
    assert '"name"' in out.parse_error


def test_truncated_call_is_flagged():
    out = parse_tool_calls('Running it.\n<tool_call>\n{"name": "shell", "argu')
    assert out.tool_calls == []
    assert out.text.endswith('"argu')
    assert "unterminated" in out.parse_error


def test_qwen3_coder_xml_with_schema_types():
    raw = (
        "I'll run it.\n<tool_call>\n<function=shell>\n<parameter=command>\necho 'a <b>'\nprintf x\n</parameter>\n"
        "<parameter=timeout>\n30\n</parameter>\n<parameter=env>\n{\"A\": \"1\"}\n</parameter>\n"
        "<parameter=background>\nfalse\n</parameter>\n</function>\n</tool_call>"
    )
    out = parse_tool_calls(raw, [SHELL])
    assert out.text == "I'll run it."
    assert out.parse_error == ""
    (call,) = out.tool_calls
    assert call.name == "shell"
    assert json.loads(call.arguments) == {"command": "echo 'a <b>'\nprintf x", "timeout": 30, "env": {"A": "1"}, "background": False}


def test_qwen3_coder_string_param_that_looks_like_json_stays_string():
    raw = "<tool_call>\n<function=shell>\n<parameter=command>\n123\n</parameter>\n</function>\n</tool_call>"
    assert json.loads(parse_tool_calls(raw, [SHELL]).tool_calls[0].arguments) == {"command": "123"}


def test_qwen3_coder_bare_function_block():
    out = parse_tool_calls("<function=shell>\n<parameter=command>\nls\n</parameter>\n</function>", [SHELL])
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("shell", {"command": "ls"})]


def test_xml_without_function_element_is_flagged():
    out = parse_tool_calls("<tool_call>\n<function=shell>\n<parameter=command>\nls\n</tool_call>", [SHELL])
    assert out.tool_calls == [] and "no complete <function" in out.parse_error


def test_plain_text_untouched():
    assert parse_tool_calls("  just text \n").text == "  just text \n"


def test_reasoning_split():
    assert split_reasoning("<think>\nhmm\n</think>\n\nAnswer") == ("hmm", "Answer")
    assert split_reasoning("hmm</think>Answer") == ("hmm", "Answer")  # template opened the block
    assert split_reasoning("no thinking") == ("", "no thinking")
    assert split_reasoning("text <think>x</think> y") == ("", "text <think>x</think> y")


def test_parse_completion_reasoning_and_call():
    out = Parsers().parse('<think>need ls</think>\n<tool_call>{"name": "shell", "arguments": {"command": "ls"}}</tool_call>')
    assert out.reasoning == "need ls"
    assert out.text == ""
    assert out.tool_calls[0].name == "shell"
