"""GLM-4.5 / GLM-4.6 tool calls (vLLM's ``glm45``):
``<tool_call>name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>``."""

import json
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.canonical import Tool
from gateway.toolparse import Parsers, think
from gateway.toolparse.base import Signature
from gateway.toolparse.glm45 import PARSER

HERE = Path(__file__).parent
FAMILIES = HERE / "families"
FIXTURE = FAMILIES / "glm45.jinja"
REASONING = next(p for p in think.PARSERS if p.name == PARSER.reasoning)
GLM = Parsers(PARSER, REASONING)

# The special tokens of the GLM-4.5 / 4.6 tokenizer that matter here (each a single added token).
GLM_TOKENS = frozenset({
    "<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "/nothink",
})
QWEN_TOKENS = frozenset({"<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>",
                         "<think>", "</think>"})

WEATHER = Tool(name="get_weather", parameters={"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}})
TYPED = Tool(name="edit", parameters={"type": "object", "properties": {
    "path": {"type": "string"}, "code": {"type": "string"}, "line": {"type": "integer"}, "scale": {"type": "number"},
    "dry_run": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
    "limit": {"type": ["integer", "null"]}}})


def parse(text, tools=(WEATHER,)):
    return GLM.parse(text, list(tools))


def calls(out):
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


def test_single_call():
    out = parse("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
    assert calls(out) == [("get_weather", {"city": "Paris", "days": 3})]
    assert out.text == "" and out.parse_error == "" and out.reasoning == ""
    assert out.tool_calls[0].id.startswith("call_")


def test_several_calls_get_distinct_ids():
    # Model output from vLLM's tests/tool_use/test_glm4_moe_tool_parser.py ("multiple_tool_calls").
    raw = """<tool_call>get_current_weather
    <arg_key>city</arg_key>
    <arg_value>Dallas</arg_value>
    <arg_key>state</arg_key>
    <arg_value>TX</arg_value>
    <arg_key>unit</arg_key>
    <arg_value>fahrenheit</arg_value>
    </tool_call>
    <tool_call>get_current_weather
    <arg_key>city</arg_key>
    <arg_value>Orlando</arg_value>
    <arg_key>state</arg_key>
    <arg_value>FL</arg_value>
    <arg_key>unit</arg_key>
    <arg_value>fahrenheit</arg_value>
    </tool_call>"""
    out = parse(raw)
    assert calls(out) == [("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}),
                          ("get_current_weather", {"city": "Orlando", "state": "FL", "unit": "fahrenheit"})]
    assert len({c.id for c in out.tool_calls}) == 2
    assert out.text == "" and out.parse_error == ""


def test_text_before_and_between_calls_is_kept():
    # Model output from vLLM's tests/tool_use/test_glm4_moe_tool_parser.py (test_extract_tool_calls_mixed_content).
    raw = """I will help you get the weather info.

<tool_call>get_weather
<arg_key>city</arg_key>
<arg_value>Beijing</arg_value>
<arg_key>date</arg_key>
<arg_value>2025-08-01</arg_value>
</tool_call>

meaningwhile, I will also check the weather in Shanghai.

<tool_call>get_weather
<arg_key>city</arg_key>
<arg_value>Shanghai</arg_value>
<arg_key>date</arg_key>
<arg_value>2025-08-01</arg_value>
</tool_call>"""
    out = parse(raw)
    assert calls(out) == [("get_weather", {"city": "Beijing", "date": "2025-08-01"}),
                          ("get_weather", {"city": "Shanghai", "date": "2025-08-01"})]
    assert out.text == ("I will help you get the weather info.\n\n\n\n"
                        "meaningwhile, I will also check the weather in Shanghai.")


def test_text_directly_before_call():
    # vLLM's test file, "tool_call_with_chinese_content" case: no space before the opener.
    out = parse("I will help you get the weather.<tool_call>get_weather\n    <arg_key>city</arg_key>\n"
                "    <arg_value>Beijing</arg_value>\n    </tool_call>")
    assert out.text == "I will help you get the weather."
    assert calls(out) == [("get_weather", {"city": "Beijing"})]


def test_with_reasoning():
    # Model output from vLLM's tests/tool_use/test_glm4_moe_tool_parser.py (test_extract_tool_calls_with_thinking_tags).
    raw = """<think>I want to get the weather.</think>

I will help you get the weather.
<tool_call>get_weather
<arg_key>city</arg_key>
<arg_value>Beijing</arg_value>
<arg_key>date</arg_key>
<arg_value>2025-08-01</arg_value>
</tool_call>"""
    out = parse(raw)
    assert out.reasoning == "I want to get the weather."
    assert out.text == "I will help you get the weather."
    assert calls(out) == [("get_weather", {"city": "Beijing", "date": "2025-08-01"})]


def test_with_reasoning_as_generated_after_the_assistant_token():
    # The template's generation prompt ends at <|assistant|>; the model then writes "\n<think>...".
    out = parse("\n<think>Paris, 2 days.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
                "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")
    assert out.reasoning == "Paris, 2 days."
    assert out.text == ""
    assert calls(out) == [("get_weather", {"city": "Paris", "days": 2})]


def test_without_reasoning():
    out = parse("Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>")
    assert out.reasoning == ""
    assert out.text == "Sure."
    assert calls(out) == [("get_weather", {"city": "Oslo"})]


def test_plain_answer_with_reasoning_and_no_call():
    out = parse("<think>Easy.</think>\nIt is 4.")
    assert (out.reasoning, out.text, out.tool_calls, out.parse_error) == ("Easy.", "It is 4.", [], "")


def test_schema_typed_arguments():
    raw = ("<tool_call>edit\n<arg_key>path</arg_key>\n<arg_value>123</arg_value>\n"
           "<arg_key>code</arg_key>\n<arg_value>  if a < b:\n      return {\"x\": 1}\n</arg_value>\n"
           "<arg_key>line</arg_key>\n<arg_value> 42 </arg_value>\n"
           "<arg_key>scale</arg_key>\n<arg_value>0.5</arg_value>\n"
           "<arg_key>dry_run</arg_key>\n<arg_value>True</arg_value>\n"
           "<arg_key>opts</arg_key>\n<arg_value>{\"mode\": \"fast\", \"é\": [1, 2]}</arg_value>\n"
           "<arg_key>tags</arg_key>\n<arg_value>[\"a\", \"b\"]</arg_value>\n"
           "<arg_key>limit</arg_key>\n<arg_value>null</arg_value>\n"
           "<arg_key>note</arg_key>\n<arg_value>7</arg_value>\n</tool_call>")
    out = parse(raw, [TYPED])
    assert out.parse_error == ""
    assert calls(out) == [("edit", {
        "path": "123",  # declared string: stays text even though it looks like JSON
        "code": "  if a < b:\n      return {\"x\": 1}\n",  # strings are kept exactly as written
        "line": 42, "scale": 0.5, "dry_run": True, "opts": {"mode": "fast", "é": [1, 2]}, "tags": ["a", "b"],
        "limit": None,
        "note": "7",  # not in the schema: text
    })]


def test_object_value_that_is_not_json_stays_as_written():
    raw = "<tool_call>edit\n<arg_key>opts</arg_key>\n<arg_value>{mode: fast}</arg_value>\n</tool_call>"
    out = parse(raw, [TYPED])
    assert calls(out) == [("edit", {"opts": "{mode: fast}"})]


def test_unknown_tool_values_stay_text():
    out = parse("<tool_call>other\n<arg_key>n</arg_key>\n<arg_value>5</arg_value>\n</tool_call>")
    assert calls(out) == [("other", {"n": "5"})]


def test_compact_form_without_newlines():
    out = parse("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
                "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>")
    assert calls(out) == [("get_weather", {"city": "Paris", "days": 3})]


def test_call_without_arguments():
    # The first output is from vLLM's tests/tool_use/test_glm4_moe_tool_parser.py
    # (test_extract_tool_calls_empty_arguments).
    assert calls(parse("<tool_call>get_current_time\n</tool_call>")) == [("get_current_time", {})]
    assert calls(parse("<tool_call>get_current_time</tool_call>")) == [("get_current_time", {})]


@pytest.mark.parametrize("end", ["<|observation|>", "<|user|>", "<|endoftext|>", ""])
def test_kept_stop_token_is_dropped(end):
    out = parse("Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n"
                f"</tool_call>{end}")
    assert calls(out) == [("get_weather", {"city": "Rome"})]
    assert out.text == "Checking." and out.parse_error == ""
    assert parse(f"Hello there.{end}").text == "Hello there."


def test_hermes_json_body_is_refused():
    raw = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    out = parse(raw)
    assert out.tool_calls == []
    assert out.text == raw
    assert "not <arg_key>/<arg_value> markup" in out.parse_error and "JSON object" in out.parse_error


def test_sentence_body_is_refused():
    raw = "<tool_call>Let me check the weather</tool_call>"
    out = parse(raw)
    assert out.tool_calls == [] and out.text == raw
    assert "a function name was expected" in out.parse_error and "'Let me check the weather'" in out.parse_error


def test_missing_name():
    raw = "<tool_call>\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
    out = parse(raw)
    assert out.tool_calls == [] and out.text == raw
    assert "no function name" in out.parse_error


def test_key_without_close_is_flagged():
    # Model output from vLLM's tests/tool_use/test_glm4_moe_tool_parser.py (test_extract_tool_calls_malformed_xml).
    raw = """<tool_call>get_weather
<arg_key>city</arg_key>
<arg_value>Seattle</arg_value>
<arg_key>incomplete_arg
<arg_value>value</arg_value>
</tool_call>"""
    out = parse(raw)
    assert out.tool_calls == [] and out.text == raw
    assert "'get_weather': unreadable argument markup at '<arg_key>incomplete_arg" in out.parse_error


def test_value_without_close_is_flagged():
    raw = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris\n"
           "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
    out = parse(raw)
    assert out.tool_calls == [] and out.text == raw
    assert "<arg_value> of 'city' is not closed" in out.parse_error


def test_stray_text_between_arguments_is_flagged():
    raw = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\nand then\n"
           "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
    out = parse(raw)
    assert out.tool_calls == []
    assert "unreadable argument markup at 'and then" in out.parse_error


def test_bad_block_flagged_while_good_block_parses():
    raw = ("<tool_call>{\"name\": \"x\"}</tool_call>\n"
           "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Lima</arg_value>\n</tool_call>")
    out = parse(raw)
    assert calls(out) == [("get_weather", {"city": "Lima"})]
    assert out.text == '<tool_call>{"name": "x"}</tool_call>'
    assert "JSON object" in out.parse_error


def test_truncated_generation():
    # Model output from vLLM's tests/tool_use/test_glm4_moe_tool_parser.py
    # (test_extract_tool_calls_incomplete_tool_call).
    raw = """<tool_call>get_weather
<arg_key>city</arg_key>
<arg_value>Beijing</arg_value>
<arg_key>date</arg_key>
<arg_value>2025-08-01</arg_value>"""
    out = parse(raw)
    assert out.tool_calls == [] and out.text == raw
    assert "unterminated" in out.parse_error


def test_truncated_after_a_complete_call():
    raw = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Lima</arg_value>\n</tool_call>\n"
           "<tool_call>get_weather\n<arg_key>ci")
    out = parse(raw)
    assert calls(out) == [("get_weather", {"city": "Lima"})]
    assert out.text == "<tool_call>get_weather\n<arg_key>ci"
    assert "unterminated" in out.parse_error


def _render(messages, tools=None, add_generation_prompt=False):
    """The fixture rendered as transformers renders chat templates (its environment and ``tojson``)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    return env.from_string(FIXTURE.read_text()).render(messages=messages, tools=tools,
                                                       add_generation_prompt=add_generation_prompt)


def test_template_rendered_call_parses_back():
    args = {"path": "a.py", "code": "x = {'k': 1}\n", "line": 3, "scale": 1.5, "dry_run": False,
            "opts": {"mode": "fast", "é": [1, None]}, "tags": [], "limit": None}
    turn = {"role": "assistant", "reasoning_content": "Edit it.", "content": "Editing.",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "edit", "arguments": args}},
                           {"id": "call_2", "type": "function", "function": {"name": "edit", "arguments": {}}}]}
    prompt = _render([{"role": "user", "content": "go"}], add_generation_prompt=True)
    full = _render([{"role": "user", "content": "go"}, turn])
    assert full.startswith(prompt)
    out = GLM.parse(full[len(prompt):], [TYPED])  # the assistant turn as the model would have generated it
    assert out.parse_error == ""
    assert (out.reasoning, out.text) == ("Edit it.", "Editing.")
    assert calls(out) == [("edit", args), ("edit", {})]


def test_template_drops_reasoning_of_earlier_turns():
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "reasoning_content": "old", "content": "A"},
            {"role": "user", "content": "b"}, {"role": "assistant", "reasoning_content": "new", "content": "B"}]
    assert _render(msgs).endswith(
        "<|user|>\na<|assistant|>\n<think></think>\nA<|user|>\nb<|assistant|>\n<think>new</think>\nB")


def test_detect_fixture_and_special_tokens():
    assert PARSER.detect(Signature(template=FIXTURE.read_text(), special_tokens=GLM_TOKENS))
    assert PARSER.detect(Signature(template=FIXTURE.read_text()))
    assert PARSER.detect(Signature(special_tokens=GLM_TOKENS))


def test_detect_rejects_hermes_template():
    qwen = (HERE / "qwen_template.jinja").read_text()
    assert not PARSER.detect(Signature(template=qwen, special_tokens=QWEN_TOKENS))


@pytest.mark.parametrize("fixture", sorted(p.name for p in FAMILIES.glob("*.jinja") if p.name != FIXTURE.name))
def test_detect_rejects_other_families(fixture):
    assert not PARSER.detect(Signature(template=(FAMILIES / fixture).read_text()))


def test_registry_entry():
    assert (PARSER.name, PARSER.reasoning, PARSER.markers) == ("glm45", "glm45", ("<tool_call>",))
    assert REASONING.name == "glm45"
