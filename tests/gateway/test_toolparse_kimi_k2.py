"""Kimi-K2 tool-call markup (vLLM's ``kimi_k2`` tool and reasoning parsers)."""

import json
from pathlib import Path

import pytest

from gateway.canonical import Tool
from gateway.toolparse import Parsers, think
from gateway.toolparse.base import Signature
from gateway.toolparse.kimi_k2 import PARSER, REASONING

FAMILIES = Path(__file__).parent / "families"
# What Kimi-K2's tokenizer_config.json lists in added_tokens_decoder (K2-Thinking adds <think> and </think>).
TOKENS = frozenset({"[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                    "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|tool_calls_section_begin|>",
                    "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                    "<|tool_call_end|>", "<|im_middle|>"})
THINKING_TOKENS = TOKENS | {"<think>", "</think>"}
WEATHER = Tool(name="get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}}})

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
C, A, E = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
EOT = "<|im_end|>"


def calls(out):
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


def call(call_id, args):
    """One call; ``args`` a dict (dumped as JSON) or the raw text the model wrote."""
    return C + call_id + A + (args if isinstance(args, str) else json.dumps(args)) + E


def test_single_call():
    out = PARSER.parse(SB + call("functions.get_weather:0", {"city": "Paris"}) + SE, {})
    assert calls(out) == [("get_weather", {"city": "Paris"})]
    assert out.text == "" and out.parse_error == ""
    assert out.tool_calls[0].id == "functions.get_weather:0"  # the model's own id, as vLLM returns it


def test_call_with_content_before_and_spaces_around_markers():
    # Model output from vLLM tests/tool_use/test_kimi_k2_tool_parser.py (tool_call_with_content_before).
    raw = ("I'll help you check the weather. <|tool_calls_section_begin|> <|tool_call_begin|>\n"
           'functions.get_weather:0 <|tool_call_argument_begin|> {"city": "Beijing"} <|tool_call_end|> '
           "<|tool_calls_section_end|>")
    out = PARSER.parse(raw, {})
    assert calls(out) == [("get_weather", {"city": "Beijing"})]
    assert out.text == "I'll help you check the weather."
    assert out.parse_error == ""


def test_several_calls_get_distinct_ids():
    # Model output from vLLM tests/tool_use/test_kimi_k2_tool_parser.py (three_concatenated_tool_calls).
    raw = ("I'll help you with multiple tasks. <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
           '<|tool_call_argument_begin|>{"city": "New York"}<|tool_call_end|><|tool_call_begin|>functions.get_news:1'
           '<|tool_call_argument_begin|>{"topic": "technology"}<|tool_call_end|><|tool_call_begin|>'
           'functions.send_email:2<|tool_call_argument_begin|>{"to": "user@example.com", "subject": "Daily Update"}'
           "<|tool_call_end|><|tool_calls_section_end|>")
    out = PARSER.parse(raw, {})
    assert calls(out) == [("get_weather", {"city": "New York"}), ("get_news", {"topic": "technology"}),
                          ("send_email", {"to": "user@example.com", "subject": "Daily Update"})]
    assert len({c.id for c in out.tool_calls}) == 3
    assert out.text == "I'll help you with multiple tasks." and out.parse_error == ""


def test_mixed_spacing_and_empty_arguments():
    # Model output from vLLM tests/tool_use/test_kimi_k2_tool_parser.py (mixed_spacing_tool_calls).
    raw = ("Mixed spacing test. <|tool_calls_section_begin|> <|tool_call_begin|> functions.test:0 "
           "<|tool_call_argument_begin|> {} <|tool_call_end|><|tool_call_begin|>functions.test2:1"
           "<|tool_call_argument_begin|>{}<|tool_call_end|> <|tool_calls_section_end|>")
    out = PARSER.parse(raw, {})
    assert calls(out) == [("test", {}), ("test2", {})]
    assert out.text == "Mixed spacing test."


def test_angle_brackets_and_newlines_in_json():
    # Model outputs from vLLM tests/tool_use/test_kimi_k2_tool_parser.py (angle_brackets_in_json, newlines_in_json).
    html = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.process_html:0<|tool_call_argument_begin|>'
            '{"html": "<div>content</div>", "text": "normal text"}<|tool_call_end|><|tool_calls_section_end|>')
    pretty = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.process_data:0<|tool_call_argument_begin|>{\n'
              '  "name": "test",\n  "value": 123,\n  "nested": {\n    "key": "value"\n  }\n}'
              "<|tool_call_end|><|tool_calls_section_end|>")
    out = PARSER.parse(html + "\n" + pretty, {})
    assert calls(out) == [("process_html", {"html": "<div>content</div>", "text": "normal text"}),
                          ("process_data", {"name": "test", "value": 123, "nested": {"key": "value"}})]
    assert out.parse_error == ""


def test_json_types_are_kept():
    out = PARSER.parse(SB + call("functions.shell:0", '{"command": "ls", "timeout": 30, "bg": false}') + SE, {})
    assert json.loads(out.tool_calls[0].arguments) == {"command": "ls", "timeout": 30, "bg": False}


def test_text_after_the_section_is_kept():
    out = PARSER.parse("Checking." + SB + call("functions.get_weather:0", {"city": "Oslo"}) + SE + " Done.", {})
    assert calls(out) == [("get_weather", {"city": "Oslo"})]
    assert out.text == "Checking. Done."  # vLLM drops what follows the section; we keep what the model wrote


def test_end_of_turn_marker_present_or_not():
    body = SB + call("functions.get_weather:0", {"city": "Rome"}) + SE
    for raw in (body, body + EOT):
        out = PARSER.parse(raw, {})
        assert calls(out) == [("get_weather", {"city": "Rome"})]
        assert out.text == "" and out.parse_error == ""
    plain = PARSER.parse("Hello!" + EOT, {})
    assert plain.text == "Hello!" and plain.parse_error == ""


def test_section_end_missing_after_complete_calls():
    # The model stopped (<|im_end|>) right after its last call: every call is complete, so they count.
    out = PARSER.parse(SB + call("functions.a:0", {"x": 1}) + call("functions.b:1", {}) + EOT, {})
    assert calls(out) == [("a", {"x": 1}), ("b", {})]
    assert out.text == "" and out.parse_error == ""


def test_id_without_functions_prefix_and_dotted_names():
    assert calls(PARSER.parse(SB + call("get_weather:3", {"city": "Lima"}) + SE, {})) == [
        ("get_weather", {"city": "Lima"})]
    # A dotted tool name stays whole; vLLM's last-dotted-part reading is used only when that is the tool.
    assert calls(PARSER.parse(SB + call("functions.mcp.search:0", {}) + SE, {}))[0][0] == "mcp.search"
    search = Tool(name="search")
    assert calls(PARSER.parse(SB + call("functions.mcp.search:0", {}) + SE, {"search": search}))[0][0] == "search"


def test_singular_section_spelling():
    raw = ("<|tool_call_section_begin|>" + call("functions.get_weather:0", {"city": "Kyiv"})
           + "<|tool_call_section_end|>")
    out = PARSER.parse(raw, {})
    assert calls(out) == [("get_weather", {"city": "Kyiv"})] and out.text == ""


def test_with_reasoning_through_parsers():
    raw = ("<think>The user wants weather; call the tool.</think>Let me check."
           + SB + call("functions.get_weather:0", {"city": "Paris"}) + SE)
    for reasoning in (REASONING, {p.name: p for p in think.PARSERS}["kimi_k2"]):
        out = Parsers(PARSER, reasoning).parse(raw, [WEATHER])
        assert out.reasoning == "The user wants weather; call the tool."
        assert out.text == "Let me check."
        assert calls(out) == [("get_weather", {"city": "Paris"})]
        assert out.parse_error == ""


def test_section_ends_thinking_without_close_tag():
    # K2-Thinking may open the tool-call section straight from its thinking (vLLM's kimi_k2 reasoning parser
    # ends the reasoning there too).
    raw = "<think>Need the weather first." + SB + call("functions.get_weather:0", {"city": "Paris"}) + SE
    out = Parsers(PARSER, REASONING).parse(raw, [WEATHER])
    assert out.reasoning == "Need the weather first."
    assert calls(out) == [("get_weather", {"city": "Paris"})]
    assert out.text == "" and out.parse_error == ""
    late_close = "<think>Plan." + SB + call("functions.get_weather:0", {"city": "Oslo"}) + SE + "</think>"
    out = Parsers(PARSER, REASONING).parse(late_close, [WEATHER])
    assert out.reasoning == "Plan." and out.text == "" and calls(out) == [("get_weather", {"city": "Oslo"})]


def test_without_reasoning():
    # Kimi-K2-Instruct does not think: text before the section is the answer's, not reasoning.
    raw = "Let me check." + SB + call("functions.get_weather:0", {"city": "Paris"}) + SE + EOT
    out = Parsers(PARSER, REASONING).parse(raw, [WEATHER])
    assert out.reasoning == ""
    assert out.text == "Let me check."
    assert calls(out) == [("get_weather", {"city": "Paris"})]
    assert REASONING.split("Just text.") == ("", "Just text.")


def test_invalid_json_stays_text_while_the_valid_call_parses():
    # Model output from vLLM tests/tool_use/test_kimi_k2_tool_parser.py (test_extract_tool_calls_invalid_json);
    # vLLM passes the broken arguments through, we keep that call as text and name the problem.
    raw = ("I'll help you check the weather. <|tool_calls_section_begin|> <|tool_call_begin|>\n"
           'functions.invalid_get_weather:0 <|tool_call_argument_begin|> {"city": "Beijing" <|tool_call_end|> '
           "<|tool_call_begin|>\n"
           'functions.valid_get_weather:1 <|tool_call_argument_begin|> {"city": "Shanghai"} <|tool_call_end|> '
           "<|tool_calls_section_end|>")
    out = PARSER.parse(raw, {})
    assert calls(out) == [("valid_get_weather", {"city": "Shanghai"})]
    assert 'functions.invalid_get_weather:0 <|tool_call_argument_begin|> {"city": "Beijing"' in out.text
    assert "'invalid_get_weather': arguments is not valid JSON" in out.parse_error


def test_bad_call_id_stays_text():
    # Model output from vLLM tests/tool_use/test_kimi_k2_tool_parser.py (test_extract_tool_calls_invalid_funcall).
    raw = ("I'll help you check the weather. <|tool_calls_section_begin|> <|tool_call_begin|>\n"
           'functions.invalid_get_weather.0 <|tool_call_argument_begin|> {"city": "Beijing"} <|tool_call_end|> '
           "<|tool_call_begin|>\n"
           'functions.valid_get_weather:1 <|tool_call_argument_begin|> {"city": "Shanghai"} <|tool_call_end|> '
           "<|tool_calls_section_end|>")
    out = PARSER.parse(raw, {})
    assert calls(out) == [("valid_get_weather", {"city": "Shanghai"})]
    assert "functions.invalid_get_weather.0" in out.text
    assert "is not functions.NAME:INDEX" in out.parse_error


def test_missing_function_name():
    raw = SB + call("functions.:0", {"city": "Paris"}) + SE
    out = PARSER.parse(raw, {})
    assert out.tool_calls == [] and out.text == raw
    assert "has no function name" in out.parse_error


def test_missing_argument_marker():
    raw = SB + C + 'functions.get_weather:0 {"city": "Paris"}' + E + SE
    out = PARSER.parse(raw, {})
    assert out.tool_calls == [] and out.text == raw
    assert "<|tool_call_argument_begin|>" in out.parse_error


def test_arguments_not_an_object():
    raw = SB + call("functions.get_weather:0", '["Paris"]') + SE
    out = PARSER.parse(raw, {})
    assert out.tool_calls == [] and out.text == raw
    assert "must be a JSON object" in out.parse_error


def test_truncated_inside_arguments():
    raw = "Checking." + SB + C + "functions.get_weather:0" + A + '{"city": "Pa'
    out = PARSER.parse(raw, {})
    assert out.tool_calls == [] and out.text == raw
    assert "unterminated" in out.parse_error


def test_truncated_second_call_keeps_first():
    tail = C + "functions.b:1" + A + '{"x'
    out = PARSER.parse(SB + call("functions.a:0", {}) + tail, {})
    assert calls(out) == [("a", {})]
    assert out.text == tail
    assert "unterminated" in out.parse_error


def test_truncated_right_after_section_opener():
    out = PARSER.parse("Checking." + SB, {})
    assert out.tool_calls == [] and out.text == "Checking." + SB
    assert "tool calls section is unterminated" in out.parse_error


def test_section_without_calls_is_unknown_shape():
    raw = SB + '{"name": "get_weather", "arguments": {"city": "Paris"}}' + SE
    out = PARSER.parse(raw, {})
    assert out.tool_calls == [] and out.text == raw
    assert "holds no <|tool_call_begin|>...<|tool_call_end|> call" in out.parse_error


def test_call_missing_its_end_stays_text_and_next_call_parses():
    broken = C + "functions.a:0" + A + '{"x": 1}'
    out = PARSER.parse(SB + broken + call("functions.b:1", {"y": 2}) + SE, {})
    assert calls(out) == [("b", {"y": 2})]
    assert out.text == SB + broken
    assert out.parse_error


def test_plain_text_untouched():
    out = PARSER.parse("No tools needed: 2 + 2 = 4.", {})
    assert out.text == "No tools needed: 2 + 2 = 4." and out.tool_calls == [] and out.parse_error == ""


def test_calls_keep_the_ids_the_model_wrote():
    """The template renders them back (the call, and ``## Return of <id>``): a fresh id would be text the
    model never wrote."""
    raw = "x" + SB + call("functions.get_weather:0", {}) + call("functions.get_news:1", {}) + SE
    assert [c.id for c in PARSER.parse(raw, {}).tool_calls] == ["functions.get_weather:0", "functions.get_news:1"]


def _fixture(name):
    return (FAMILIES / name).read_text(encoding="utf-8")


def test_detect_own_template_and_tokens():
    assert PARSER.detect(Signature(_fixture("kimi_k2.jinja"), TOKENS))
    assert PARSER.detect(Signature(_fixture("kimi_k2.jinja")))  # the template alone shows the section markers
    assert PARSER.detect(Signature("", TOKENS))  # and so do the tokens alone: no other family has them
    assert REASONING.detect(Signature("", THINKING_TOKENS)) and not REASONING.detect(Signature("", TOKENS))


def test_names_and_markers():
    assert (PARSER.name, PARSER.reasoning, REASONING.name) == ("kimi_k2", "kimi_k2", "kimi_k2")
    assert PARSER.reasoning in think.NAMES
    assert SB in PARSER.markers and C in PARSER.markers


@pytest.mark.parametrize("path", [Path(__file__).parent / "qwen_template.jinja",
                                  *sorted(p for p in FAMILIES.glob("*.jinja") if p.name != "kimi_k2.jinja")],
                         ids=lambda p: p.name)
def test_other_families_not_detected(path):
    sig = Signature(path.read_text(encoding="utf-8"))
    assert not PARSER.detect(sig) and not REASONING.detect(sig)
