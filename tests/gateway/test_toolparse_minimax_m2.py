"""MiniMax-M2 tool calls (``<minimax:tool_call>`` / ``<invoke>`` / ``<parameter>``)."""

import json
from pathlib import Path

import jinja2
import pytest

from gateway.canonical import Tool
from gateway.toolparse import Parsers, think
from gateway.toolparse.base import Signature
from gateway.toolparse.minimax_m2 import PARSER

HERE = Path(__file__).parent
FIXTURE = HERE / "families" / "minimax_m2.jinja"
REASONING = next(p for p in think.PARSERS if p.name == "minimax_m2")

WEATHER = Tool(name="get_weather", parameters={"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}})
EDIT = Tool(name="edit", parameters={"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "line": {"type": "integer"},
    "ratio": {"type": "number"}, "dry_run": {"type": "boolean"}, "opts": {"type": "object"},
    "tags": {"type": "array"}}})
SEARCH = Tool(name="search_web", parameters={"type": "object", "properties": {
    "query_tag": {"type": "array", "items": {"type": "string"}},
    "query_list": {"type": "array", "items": {"type": "string"}}}})
TOOLS = {t.name: t for t in (WEATHER, EDIT, SEARCH)}

CALL = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
        '<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>')


def calls(out):
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


def test_one_call_with_schema_types():
    out = PARSER.parse(CALL, TOOLS)
    assert calls(out) == [("get_weather", {"city": "Paris", "days": 3})]
    assert out.text == "" and out.parse_error == ""
    assert out.tool_calls[0].id.startswith("call_")


def test_several_invokes_in_one_block_and_several_blocks():
    raw = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>\n'
           '<invoke name="get_weather">\n<parameter name="city">Rome</parameter>\n</invoke>\n</minimax:tool_call>\n'
           '<minimax:tool_call>\n<invoke name="edit">\n<parameter name="path">a.py</parameter>\n</invoke>\n'
           '</minimax:tool_call>')
    out = PARSER.parse(raw, TOOLS)
    assert calls(out) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"}),
                          ("edit", {"path": "a.py"})]
    assert len({c.id for c in out.tool_calls}) == 3
    assert out.text == "" and out.parse_error == ""


def test_text_before_and_after_calls_is_kept():
    out = PARSER.parse("Let me check the weather.\n\n" + CALL + "\nThen I will answer.", TOOLS)
    assert out.text == "Let me check the weather.\n\n\nThen I will answer."  # the text around, as written
    assert calls(out) == [("get_weather", {"city": "Paris", "days": 3})]


def test_plain_answer_without_calls():
    out = PARSER.parse("Paris is sunny today.", TOOLS)
    assert out.text == "Paris is sunny today." and out.tool_calls == [] and out.parse_error == ""


def test_turn_end_marker_is_accepted_and_dropped():
    assert PARSER.parse("Done.[e~[", TOOLS).text == "Done."
    out = PARSER.parse("On it." + CALL + "[e~[\n", TOOLS)
    assert out.text == "On it." and calls(out) == [("get_weather", {"city": "Paris", "days": 3})]


def test_with_reasoning_opened_by_the_generation_prompt():
    # The template's generation prompt ends with "]~b]ai\n<think>\n": the completion starts inside the thought.
    raw = "The user wants Paris weather.\nI'll call the tool.\n</think>\n\n" + CALL
    out = Parsers(PARSER, REASONING).parse(raw, list(TOOLS.values()))
    assert out.reasoning == "The user wants Paris weather.\nI'll call the tool."
    assert out.text == ""
    assert calls(out) == [("get_weather", {"city": "Paris", "days": 3})]


def test_with_explicit_think_block_and_text():
    raw = "<think>\nShort.\n</think>\n\nChecking now." + CALL
    out = Parsers(PARSER, REASONING).parse(raw, [WEATHER])
    assert (out.reasoning, out.text) == ("Short.", "Checking now.")
    assert [c.name for c in out.tool_calls] == ["get_weather"]


def test_without_reasoning():
    out = Parsers(PARSER, REASONING).parse("Just an answer.", [WEATHER])
    assert (out.reasoning, out.text, out.tool_calls) == ("", "Just an answer.", [])


def test_values_converted_by_schema_type():
    raw = ('<minimax:tool_call>\n<invoke name="edit">\n<parameter name="path">007.txt</parameter>\n'
           '<parameter name="line">42</parameter>\n<parameter name="ratio">0.5</parameter>\n'
           '<parameter name="dry_run">true</parameter>\n<parameter name="opts">{"b": 1, "a": [1, "é"]}</parameter>\n'
           '<parameter name="tags">["x", "y"]</parameter>\n<parameter name="extra">12</parameter>\n'
           '</invoke>\n</minimax:tool_call>')
    args = calls(PARSER.parse(raw, TOOLS))[0][1]
    assert args == {"path": "007.txt", "line": 42, "ratio": 0.5, "dry_run": True, "opts": {"b": 1, "a": [1, "é"]},
                    "tags": ["x", "y"], "extra": "12"}  # undeclared parameters stay text
    assert list(args) == ["path", "line", "ratio", "dry_run", "opts", "tags", "extra"]  # model's order kept


def test_string_values_are_verbatim_and_typed_values_tolerate_blanks():
    content = "def f(a, b):\n    return a < b && '</div>'\n"
    raw = (f'<minimax:tool_call>\n<invoke name="edit">\n<parameter name="content">{content}</parameter>\n'
           '<parameter name="line">\n7\n</parameter>\n<parameter name="zip">00123</parameter>\n'
           '</invoke>\n</minimax:tool_call>')
    assert calls(PARSER.parse(raw, TOOLS))[0][1] == {"content": content, "line": 7, "zip": "00123"}


def test_unknown_tool_values_stay_text():
    raw = '<minimax:tool_call><invoke name="other"><parameter name="n">5</parameter></invoke></minimax:tool_call>'
    assert calls(PARSER.parse(raw, TOOLS)) == [("other", {"n": "5"})]


def test_invoke_without_parameters():
    raw = '<minimax:tool_call>\n<invoke name="list_files">\n</invoke>\n</minimax:tool_call>'
    assert calls(PARSER.parse(raw, {})) == [("list_files", {})]


def test_vllm_outputs_extra_attributes_and_arrays():
    # Model outputs from vLLM's tests/tool_use/test_minimax_m2_tool_parser.py.
    raw = ('<minimax:tool_call>'
           '<invoke name="test_func" extra="ignored">'
           '<parameter name="arg1" type="string">value1</parameter>'
           '<parameter name="arg2" description="(e.g. example)">value2</parameter>'
           '</invoke>'
           '</minimax:tool_call>')
    assert calls(PARSER.parse(raw, {})) == [("test_func", {"arg1": "value1", "arg2": "value2"})]
    raw = ("<minimax:tool_call>"
           '<invoke name="search_web"><parameter name="query_tag">["technology", "events"]</parameter>'
           '<parameter name="query_list">["OpenAI", "latest", "release"]</parameter></invoke>'
           '<invoke name="search_web"><parameter name="query_tag">["technology", "events"]</parameter>'
           '<parameter name="query_list">["Gemini", "latest", "release"]</parameter></invoke>'
           "</minimax:tool_call>")
    assert calls(PARSER.parse(raw, TOOLS)) == [
        ("search_web", {"query_tag": ["technology", "events"], "query_list": ["OpenAI", "latest", "release"]}),
        ("search_web", {"query_tag": ["technology", "events"], "query_list": ["Gemini", "latest", "release"]})]
    raw = ('<minimax:tool_call><invoke name="help"><parameter name="topic">commands (e.g. ls -la, cat file.txt)'
           "</parameter></invoke></minimax:tool_call>")
    assert calls(PARSER.parse(raw, {})) == [("help", {"topic": "commands (e.g. ls -la, cat file.txt)"})]


def test_json_body_stays_text_and_is_flagged():
    raw = 'ok <minimax:tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</minimax:tool_call>'
    out = PARSER.parse(raw, TOOLS)
    assert out.tool_calls == [] and out.text == raw
    assert "no complete <invoke" in out.parse_error


def test_unknown_shape_stays_text_and_is_flagged():
    raw = ('<minimax:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n'
           '</minimax:tool_call>')
    out = PARSER.parse(raw, TOOLS)
    assert out.tool_calls == [] and out.text == raw
    assert "no complete <invoke" in out.parse_error


def test_missing_name_stays_text_and_is_flagged():
    for raw in ('<minimax:tool_call><invoke><parameter name="city">Paris</parameter></invoke></minimax:tool_call>',
                '<minimax:tool_call><invoke name="">\n</invoke></minimax:tool_call>'):
        out = PARSER.parse(raw, TOOLS)
        assert out.tool_calls == [] and out.text == raw
        assert "<invoke> has no name" in out.parse_error
    raw = '<minimax:tool_call><invoke name="get_weather"><parameter>Paris</parameter></invoke></minimax:tool_call>'
    out = PARSER.parse(raw, TOOLS)
    assert out.tool_calls == [] and "'get_weather': <parameter> has no name" in out.parse_error


def test_stray_text_inside_a_block_is_flagged():
    # An <invoke> whose </invoke> is missing, then a complete one: the block is not what the model meant.
    raw = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
           '<invoke name="get_weather">\n<parameter name="city">Rome</parameter>\n</invoke>\n</minimax:tool_call>')
    out = PARSER.parse(raw, TOOLS)
    assert out.tool_calls == [] and out.text == raw
    assert "outside complete <parameter> elements" in out.parse_error
    raw = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>\n'
           'and also\n</minimax:tool_call>')
    out = PARSER.parse(raw, TOOLS)
    assert out.tool_calls == [] and "outside complete <invoke> elements ('and also')" in out.parse_error


def test_unclosed_parameter_is_flagged():
    raw = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris\n</invoke>\n'
           '</minimax:tool_call>')
    out = PARSER.parse(raw, TOOLS)
    assert out.tool_calls == [] and out.text == raw
    assert "'get_weather': text outside complete <parameter> elements" in out.parse_error


def test_truncated_generation_stays_text_and_is_flagged():
    raw = 'Looking.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Pa'
    out = PARSER.parse(raw, TOOLS)
    assert out.tool_calls == [] and out.text == raw
    assert "unterminated <minimax:tool_call> block" in out.parse_error
    # Cut after the last </invoke> but before the block's closer: still a cut inside a call.
    out = PARSER.parse(CALL[:-len("</minimax:tool_call>")], TOOLS)
    assert out.tool_calls == [] and "unterminated" in out.parse_error


def test_bad_block_flagged_while_good_blocks_parse():
    bad = '<minimax:tool_call>{"name": "x"}</minimax:tool_call>'
    raw = CALL + "\n" + bad + "\n" + CALL.replace("Paris", "Rome") + '\n<minimax:tool_call>\n<invoke name="edit'
    out = PARSER.parse(raw, TOOLS)
    assert calls(out) == [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Rome", "days": 3})]
    assert bad in out.text and out.text.endswith('<invoke name="edit')
    assert "no complete <invoke" in out.parse_error and "unterminated" in out.parse_error


def _render(messages, **kw):
    # transformers renders chat templates with trim_blocks and lstrip_blocks, and a tojson that takes
    # json.dumps' keywords.
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, ensure_ascii=True, indent=None, separators=None, sort_keys=False: json.dumps(
        v, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    return env.from_string(FIXTURE.read_text()).render(messages=messages, **kw)


def test_template_rendering_of_calls_parses_back():
    args = [{"path": "a b.py", "content": "x = 1\n", "line": 3, "ratio": 1.5, "dry_run": False,
             "opts": {"k": [1, "é"]}, "tags": ["t"]}, {"city": "Paris", "days": 2}]
    names = ["edit", "get_weather"]
    history = [{"role": "user", "content": "go"},
               {"role": "assistant", "content": "", "reasoning_content": "plan",
                "tool_calls": [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
                               for i, (n, a) in enumerate(zip(names, args))]},
               {"role": "tool", "content": "ok"}, {"role": "tool", "content": "ok"}]
    prompt = _render(history, add_generation_prompt=True)
    assert prompt.endswith("]~b]ai\n<think>\n")
    turn = prompt.split("]~b]ai\n")[1].split("[e~[")[0]
    assert turn.startswith("<think>\nplan\n</think>\n\n")  # reasoning after the last user turn is kept
    out = Parsers(PARSER, REASONING).parse(turn, list(TOOLS.values()))
    assert calls(out) == list(zip(names, args)) and out.reasoning == "plan" and out.text == ""


def test_template_drops_reasoning_before_the_last_user_turn():
    history = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "reasoning_content": "old"},
               {"role": "user", "content": "q2"}]
    prompt = _render(history, add_generation_prompt=True)
    assert "old" not in prompt and "]~b]ai\na1[e~[\n]~b]user\nq2[e~[\n" in prompt


SPECIALS = frozenset({"]~!b[", "]~b]", "[e~[", "<minimax:tool_call>", "</minimax:tool_call>", "<think>", "</think>"})


def test_detect_own_template():
    assert PARSER.detect(Signature(FIXTURE.read_text(), SPECIALS))
    assert PARSER.detect(Signature(FIXTURE.read_text()))


def _others():
    yield HERE / "qwen_template.jinja"
    yield from (p for p in sorted((HERE / "families").glob("*.jinja")) if p != FIXTURE)


@pytest.mark.parametrize("path", list(_others()), ids=lambda p: p.name)
def test_detect_rejects_other_families(path):
    assert not PARSER.detect(Signature(path.read_text()))
