"""Llama 3.1/3.2/3.3 JSON tool calls (vLLM's llama3_json)."""

import json
from pathlib import Path

import pytest

from gateway.canonical import Tool
from gateway.toolparse import Parsers, think
from gateway.toolparse.base import NO_REASONING, Signature
from gateway.toolparse.llama3 import PARSER

HERE = Path(__file__).parent
FAMILIES = HERE / "families"
LLAMA_TOKENS = frozenset({"<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                          "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"})
SHELL = Tool(name="shell", parameters={"type": "object", "properties": {"command": {"type": "string"},
                                                                        "timeout": {"type": "integer"}}})
LLAMA = Parsers(PARSER, NO_REASONING)
THINKING = Parsers(PARSER, think.PARSERS[0])


def calls(out):
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


def test_names():
    assert PARSER.name == "llama3_json"
    assert PARSER.reasoning == NO_REASONING.name == "none"
    assert "<|python_tag|>" in PARSER.markers


def test_one_call_plain():
    out = LLAMA.parse('{"name": "shell", "parameters": {"command": "ls -la", "timeout": 30}}', [SHELL])
    assert calls(out) == [("shell", {"command": "ls -la", "timeout": 30})]
    assert out.text == "" and out.parse_error == "" and out.reasoning == ""
    assert out.tool_calls[0].id.startswith("call_")


def test_one_call_after_python_tag_with_end_marker():
    for end in ("<|eom_id|>", "<|eot_id|>", ""):
        out = LLAMA.parse('<|python_tag|>{"name": "shell", "parameters": {"command": "pwd"}}' + end, [SHELL])
        assert calls(out) == [("shell", {"command": "pwd"})], end
        assert out.text == "" and out.parse_error == "", end


def test_arguments_key_and_arguments_as_string():
    out = LLAMA.parse('{"name": "shell", "arguments": {"command": "pwd"}}')
    assert calls(out) == [("shell", {"command": "pwd"})]
    out = LLAMA.parse('{"name": "shell", "parameters": "{\\"command\\": \\"pwd\\"}"}')
    assert calls(out) == [("shell", {"command": "pwd"})]


def test_several_calls_with_separators():
    # model output from vLLM tests/entrypoints/openai/tool_parsers/test_llama3_json_tool_parser.py
    # (test_extract_tool_calls_multiple_json)
    raw = ('{"name": "searchTool", "parameters": {"query": "test1"}}; '
           '{"name": "getOpenIncidentsTool", "parameters": {}}; '
           '{"name": "searchTool", "parameters": {"query": "test2"}}')
    out = LLAMA.parse(raw)
    assert calls(out) == [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}),
                          ("searchTool", {"query": "test2"})]
    assert out.text == "" and out.parse_error == ""
    assert len({c.id for c in out.tool_calls}) == 3
    # the separators vLLM's tests/tool_parsers/test_llama3_json_tool_parser.py streams: "; ", ";", ";\n", "\n"
    for sep in ("; ", ";", ";\n", "\n", " ; "):
        out = LLAMA.parse('<|python_tag|>{"name": "a", "parameters": {"x": 1}}' + sep
                          + '{"name": "b", "parameters": {}}')
        assert calls(out) == [("a", {"x": 1}), ("b", {})], sep
        assert out.text == "" and out.parse_error == "", sep


def test_text_before_and_after_the_call():
    # model output from vLLM tests/entrypoints/openai/tool_parsers/test_llama3_json_tool_parser.py
    # (test_extract_tool_calls_simple)
    out = LLAMA.parse('Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} '
                      'Would you like to know more?')
    assert calls(out) == [("getOpenIncidentsTool", {})]
    assert out.text == "Here is the result:  Would you like to know more?"
    assert out.parse_error == ""
    out = LLAMA.parse('Let me look.\n\n<|python_tag|>{"name": "shell", "parameters": {"command": "ls"}}<|eom_id|>',
                      [SHELL])
    assert calls(out) == [("shell", {"command": "ls"})]
    assert out.text == "Let me look."


def test_several_calls_after_text():
    # model output from vLLM tests/entrypoints/openai/tool_parsers/test_llama3_json_tool_parser.py
    # (test_extract_tool_calls_multiple_json_with_surrounding_text)
    raw = ('Here are the results: {"name": "searchTool", "parameters": {"query": "test1"}}; '
           '{"name": "getOpenIncidentsTool", "parameters": {}}; '
           '{"name": "searchTool", "parameters": {"query": "test2"}} Would you like to know more?')
    out = LLAMA.parse(raw)
    assert [c.name for c in out.tool_calls] == ["searchTool", "getOpenIncidentsTool", "searchTool"]
    assert out.text == "Here are the results:  Would you like to know more?"


def test_nested_and_braces_in_strings():
    # model outputs from vLLM tests/entrypoints/openai/tool_parsers/test_llama3_json_tool_parser.py
    # (deeply_nested_json, with_quotes_and_brackets_in_string, with_escaped_quotes_in_nested_json)
    out = LLAMA.parse('{"name": "complexTool", "parameters": '
                      '{"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}}}')
    assert calls(out) == [("complexTool", {"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}})]
    out = LLAMA.parse('{"name": "searchTool", "parameters": {"query": "test {value} [complex]",'
                      '"nested": {"inner": "more {brackets}"}}}')
    assert calls(out) == [("searchTool", {"query": "test {value} [complex]", "nested": {"inner": "more {brackets}"}})]
    out = LLAMA.parse('{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}')
    assert calls(out) == [("parserTool", {"text": 'He said "Hello {world}"'})]


def test_trailing_prose_with_braces_keeps_the_call():
    # model outputs from vLLM tests/tool_parsers/test_llama3_json_tool_parser.py
    # (brace_in_trailing_text, json_fragment_in_trailing_text)
    out = LLAMA.parse('{"name": "searchTool", "parameters": {"query": "test"}} I used {searchTool} for this.')
    assert calls(out) == [("searchTool", {"query": "test"})]
    assert out.text == "I used {searchTool} for this." and out.parse_error == ""
    out = LLAMA.parse('{"name": "searchTool", "parameters": {"query": "test"}} '
                      'The arguments I passed were {"query": "test"}')
    assert calls(out) == [("searchTool", {"query": "test"})]
    assert out.text == 'The arguments I passed were {"query": "test"}' and out.parse_error == ""


def test_plain_text_with_braces_is_text_without_error():
    for raw in ("Use a dict like {a: 1} or a set {1, 2}.",
                'The config is {"debug": true, "level": {"x": [1, 2]}}.',
                '{"status": "ok", "items": [1, 2]}',
                'Your package.json says {"name": "demo", "version": "1.0.0"}.',
                "fn main() { let x = {",
                "This is just some text without any tool calls"):
        out = LLAMA.parse(raw, [SHELL])
        assert out.tool_calls == [] and out.text == raw and out.parse_error == "", raw


def test_call_shaped_json_in_prose_naming_an_undeclared_tool_stays_text():
    raw = 'For example, a call looks like {"name": "get_weather", "parameters": {"city": "Paris"}}.'
    out = LLAMA.parse(raw, [SHELL])
    assert out.tool_calls == [] and out.text == raw and out.parse_error == ""
    # without declared tools it counts, as in vLLM
    assert [c.name for c in LLAMA.parse(raw).tool_calls] == ["get_weather"]


def test_with_reasoning_and_without():
    raw = '<think>\nThe user wants files.\n</think>\n\n{"name": "shell", "parameters": {"command": "ls"}}'
    out = THINKING.parse(raw, [SHELL])
    assert out.reasoning == "The user wants files."
    assert calls(out) == [("shell", {"command": "ls"})]
    assert out.text == "" and out.parse_error == ""
    out = LLAMA.parse('Sure.<|eot_id|>', [SHELL])
    assert out.reasoning == "" and out.tool_calls == [] and out.text == "Sure." and out.parse_error == ""


def test_invalid_json_stays_text_and_is_flagged():
    raw = '{"name": "shell", "parameters": {"command": }}'
    out = LLAMA.parse(raw, [SHELL])
    assert out.tool_calls == [] and out.text == raw
    assert "not valid JSON" in out.parse_error
    raw = 'Let me check.\n{"name": "shell", "parameters": {"command": ls}}'
    out = LLAMA.parse(raw, [SHELL])
    assert out.tool_calls == [] and out.text == raw
    assert "not valid JSON" in out.parse_error
    raw = '<|python_tag|>{"name": "shell", "parameters": {"command": "ls",}}'
    out = LLAMA.parse(raw, [SHELL])
    assert out.tool_calls == [] and out.text == raw and "not valid JSON" in out.parse_error


def test_missing_name_and_missing_parameters_are_flagged():
    # model outputs from vLLM tests/tool_parsers/test_llama3_json_tool_parser.py
    # (missing_name_key, missing_parameters_and_arguments_key)
    out = LLAMA.parse('{"parameters": {}}')
    assert out.tool_calls == [] and out.text == '{"parameters": {}}'
    assert '"name"' in out.parse_error
    out = LLAMA.parse('{"name": "toolWithoutParams"}')
    assert out.tool_calls == [] and out.text == '{"name": "toolWithoutParams"}'
    assert '"parameters"' in out.parse_error
    out = LLAMA.parse('<|python_tag|>{"name": "shell", "parameters": ["ls"]}')
    assert out.tool_calls == [] and "must be a JSON object" in out.parse_error


def test_truncated_call_is_flagged():
    for raw in ('{"name": "shell", "parameters": {"command": "ls -', '<|python_tag|>{"name": "sh',
                'Running it.\n{"name": "shell", "argu', "<|python_tag|>",
                # model output from vLLM tests/entrypoints/openai/tool_parsers/test_llama3_json_tool_parser.py
                # (test_extract_tool_calls_invalid_json): the last brace never comes
                '{"name": "invalidTool", "parameters": {invalid json}'):
        out = LLAMA.parse(raw, [SHELL])
        assert out.tool_calls == [] and out.text == raw, raw
        assert "unterminated" in out.parse_error, raw


def test_unknown_shape_after_python_tag_is_flagged():
    raw = '<|python_tag|>brave_search.call(query="weather in Paris")'
    out = LLAMA.parse(raw)
    assert out.tool_calls == [] and out.text == raw
    assert "no JSON tool call" in out.parse_error


def test_bad_call_flagged_while_good_call_parses():
    raw = '{"name": "shell", "parameters": {"command": "ls"}}; {"nam": "x", "parameters": {}}'
    out = LLAMA.parse(raw, [SHELL])
    assert calls(out) == [("shell", {"command": "ls"})]
    assert out.text == '; {"nam": "x", "parameters": {}}'
    assert '"name"' in out.parse_error
    raw = '{"name": "a", "parameters": {bad}}; {"name": "shell", "parameters": {"command": "pwd"}}'
    out = LLAMA.parse(raw, [SHELL])
    assert calls(out) == [("shell", {"command": "pwd"})]
    assert out.text == '{"name": "a", "parameters": {bad}}'
    assert "not valid JSON" in out.parse_error


def test_call_then_truncated_second_call():
    raw = '{"name": "shell", "parameters": {"command": "ls"}}; {"name": "shell", "param'
    out = LLAMA.parse(raw, [SHELL])
    assert calls(out) == [("shell", {"command": "ls"})]
    assert out.text == '; {"name": "shell", "param'
    assert "unterminated" in out.parse_error


def test_values_stay_as_the_model_typed_them():
    # JSON markup: values are JSON already, no schema conversion (a string "30" stays a string)
    out = LLAMA.parse('{"name": "shell", "parameters": {"command": "123", "timeout": "30"}}', [SHELL])
    assert calls(out) == [("shell", {"command": "123", "timeout": "30"})]


def test_detect_on_fixture_template():
    template = (FAMILIES / "llama3.jinja").read_text()
    assert template.startswith("{#- source: ")
    assert PARSER.detect(Signature(template, LLAMA_TOKENS))
    assert not PARSER.detect(Signature("", LLAMA_TOKENS))  # tokens alone: pythonic Llama templates share them


def test_detect_false_on_hermes_template():
    assert not PARSER.detect(Signature((HERE / "qwen_template.jinja").read_text(),
                                       frozenset({"<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>"})))


@pytest.mark.parametrize("path", sorted(p for p in FAMILIES.glob("*.jinja") if p.name != "llama3.jinja"),
                         ids=lambda p: p.stem)
def test_detect_false_on_other_families(path):
    assert not PARSER.detect(Signature(path.read_text()))
