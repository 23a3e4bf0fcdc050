"""DeepSeek-V3.1 / V3 tool-call markup (vLLM's ``deepseek_v31`` and ``deepseek_v3`` parsers)."""

import json
from pathlib import Path

import pytest

from gateway.canonical import Tool
from gateway.toolparse import Parsers, think
from gateway.toolparse.base import Signature
from gateway.toolparse.deepseek import PARSER, V3

FAMILIES = Path(__file__).parent / "families"
OWN = ("deepseek.jinja", "deepseek_v3.jinja")
TOKENS = frozenset({"<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                    "<｜tool▁output▁end｜>", "<think>", "</think>"})
REASONING = {p.name: p for p in think.PARSERS}
WEATHER = Tool(name="get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}}})

CB, CE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
C, E, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
EOS = "<｜end▁of▁sentence｜>"


def calls(out):
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


def _args(args):
    return args if isinstance(args, str) else json.dumps(args)


def v31(name, args):
    """One V3.1 call; ``args`` a dict (dumped as JSON) or the raw text the model wrote."""
    return C + name + SEP + _args(args) + E


def v3(name, args):
    """One V3 / R1 call: type, name, then the arguments in a ```json fence."""
    return C + "function" + SEP + name + "\n```json\n" + _args(args) + "\n```" + E


def test_v31_single_call():
    out = PARSER.parse(CB + v31("get_weather", {"city": "Paris"}) + CE, {})
    assert calls(out) == [("get_weather", {"city": "Paris"})]
    assert out.text == "" and out.parse_error == ""
    assert out.tool_calls[0].id.startswith("call_")


def test_v31_several_calls_with_text_before_and_after():
    # Model output from vLLM tests/tool_parsers/test_deepseekv31_tool_parser.py (multiple tools).
    raw = "some prefix text" + CB + v31("foo", '{"x":1}') + v31("bar", '{"y":2}') + CE + " some suffix text"
    out = PARSER.parse(raw, {})
    assert calls(out) == [("foo", {"x": 1}), ("bar", {"y": 2})]
    assert len({c.id for c in out.tool_calls}) == 2
    assert out.text == "some prefix text some suffix text"  # vLLM drops the suffix; we keep what the model wrote
    assert out.parse_error == ""


def test_end_of_sentence_token_accepted_or_absent():
    body = "Checking." + CB + v31("get_weather", {"city": "Oslo"}) + CE
    for raw in (body, body + EOS, body + EOS + "\n"):
        out = PARSER.parse(raw, {})
        assert calls(out) == [("get_weather", {"city": "Oslo"})]
        assert out.text == "Checking."
    assert PARSER.parse("Just an answer." + EOS, {}).text == "Just an answer."


def test_v31_with_reasoning_through_parsers():
    # V3.1 thinking mode: the prompt ends with <think>, so the completion starts inside it.
    raw = "The user wants weather.</think>Let me check." + CB + v31("get_weather", {"city": "Paris"}) + CE + EOS
    out = Parsers(PARSER, REASONING[PARSER.reasoning]).parse(raw, [WEATHER])
    assert out.reasoning == "The user wants weather."
    assert out.text == "Let me check."
    assert calls(out) == [("get_weather", {"city": "Paris"})]


def test_v31_without_reasoning_through_parsers():
    out = Parsers(PARSER, REASONING["deepseek_v3"]).parse(CB + v31("get_weather", {"city": "Paris"}) + CE, [WEATHER])
    assert out.reasoning == "" and out.text == ""
    assert calls(out) == [("get_weather", {"city": "Paris"})]


def test_v3_fenced_calls_and_newline_between():
    # Model output from vLLM tests/tool_parsers/test_deepseekv3_tool_parser.py (parallel calls), plus the
    # newline V3's template puts between calls.
    raw = ("Let me check." + CB + v3("get_weather", '{"city": "Tokyo", "unit": "celsius"}') + "\n"
           + v3("search_hotels", '{"location": "Tokyo", "check_in": "2025-01-15"}') + CE + EOS)
    out = V3.parse(raw, {})
    assert calls(out) == [("get_weather", {"city": "Tokyo", "unit": "celsius"}),
                          ("search_hotels", {"location": "Tokyo", "check_in": "2025-01-15"})]
    assert out.text == "Let me check." and out.parse_error == ""


def test_v3_with_r1_reasoning_through_parsers():
    raw = "<think>\nneed weather\n</think>\n\n" + CB + v3("get_weather", {"city": "Paris"}) + CE
    out = Parsers(V3, REASONING[V3.reasoning]).parse(raw, [WEATHER])
    assert out.reasoning == "need weather"
    assert calls(out) == [("get_weather", {"city": "Paris"})]
    assert out.text == ""


def test_v3_multiline_arguments_and_escapes():
    # Escapes from vLLM tests/tool_parsers/test_deepseekv3_tool_parser.py (escaped_strings_output).
    args = '{\n  "text": "He said \\"hello\\"",\n  "path": "C:\\\\Users\\\\file",\n  "newline": "line1\\nline2"\n}'
    out = V3.parse(CB + v3("send_message", args) + CE, {})
    assert calls(out) == [("send_message", {"text": 'He said "hello"', "path": "C:\\Users\\file",
                                            "newline": "line1\nline2"})]


def test_arguments_given_as_json_string():
    out = PARSER.parse(CB + v31("f", json.dumps(json.dumps({"a": 1}))) + CE, {})
    assert calls(out) == [("f", {"a": 1})]


def test_bad_json_stays_text_and_good_call_beside_it_parses():
    bad = v31("get_weather", '{"city": }')
    out = PARSER.parse(CB + bad + v31("get_weather", {"city": "Rome"}) + CE, {})
    assert calls(out) == [("get_weather", {"city": "Rome"})]
    assert out.text == CB + bad
    assert "'get_weather': arguments is not valid JSON" in out.parse_error


def test_v3_bad_json_is_named():
    # From vLLM tests/tool_parsers/test_deepseekv3_tool_parser.py (malformed_input_outputs[0]).
    raw = CB + v3("get_weather", '{"city": "Tokyo"') + CE
    out = V3.parse(raw, {})
    assert out.tool_calls == [] and out.text == raw
    assert "not valid JSON" in out.parse_error


def test_arguments_not_an_object():
    out = PARSER.parse(CB + v31("f", "[1, 2]") + CE, {})
    assert out.tool_calls == []
    assert "must be a JSON object" in out.parse_error


def test_missing_name():
    raw = CB + v31("", {"x": 1}) + CE
    out = PARSER.parse(raw, {})
    assert out.tool_calls == [] and out.text == raw
    assert "no function name" in out.parse_error


def test_call_without_separator_is_unknown_shape():
    raw = CB + C + 'get_weather {"city": "Paris"}' + E + CE
    out = PARSER.parse(raw, {})
    assert out.tool_calls == [] and out.text == raw
    assert "no <｜tool▁sep｜>" in out.parse_error


def test_v3_fence_broken_is_named():
    raw = CB + C + "function" + SEP + 'get_weather\n```json\n{"city": "Paris"}' + E + CE
    out = V3.parse(raw, {})
    assert out.tool_calls == [] and out.text == raw
    assert "```json block" in out.parse_error


def test_section_without_call_markers():
    # From vLLM tests/tool_parsers/test_deepseekv31_tool_parser.py (start token, no call markers).
    raw = CB + "foo" + SEP + '{"x":1}' + CE
    out = PARSER.parse(raw, {})
    assert out.tool_calls == [] and out.text == raw
    assert "holds no" in out.parse_error


def test_truncated_before_first_call():
    # From vLLM tests/tool_parsers/test_deepseekv31_tool_parser.py (cut off part way through the block).
    raw = "Let me look that up." + CB + "get_weather"
    out = PARSER.parse(raw, {})
    assert out.tool_calls == [] and out.text == raw
    assert "unterminated" in out.parse_error


def test_truncated_inside_a_call():
    raw = "Checking." + CB + C + "get_weather" + SEP + '{"city": "Par'
    out = PARSER.parse(raw, {})
    assert out.tool_calls == [] and out.text == raw
    assert "unterminated" in out.parse_error


def test_truncated_second_call_keeps_first():
    tail = C + "b" + SEP + '{"x'
    out = PARSER.parse(CB + v31("a", {}) + tail, {})
    assert calls(out) == [("a", {})]
    assert out.text == tail
    assert "unterminated" in out.parse_error


def test_call_missing_its_end_stays_text_and_next_call_parses():
    broken = C + "a" + SEP + '{"x": 1}'
    out = PARSER.parse(CB + broken + v31("b", {"y": 2}) + CE, {})
    assert calls(out) == [("b", {"y": 2})]
    assert out.text == CB + broken
    assert out.parse_error


def test_plain_text_untouched():
    out = PARSER.parse("No tools needed: 2 + 2 = 4.", {})
    assert out.text == "No tools needed: 2 + 2 = 4." and out.tool_calls == [] and out.parse_error == ""


def _fixture(name):
    return (FAMILIES / name).read_text(encoding="utf-8")


def test_detect_v31_template():
    sig = Signature(_fixture("deepseek.jinja"), TOKENS)
    assert PARSER.detect(sig) and not V3.detect(sig)


def test_detect_v3_template():
    sig = Signature(_fixture("deepseek_v3.jinja"), TOKENS)
    assert V3.detect(sig) and not PARSER.detect(sig)


def test_tokens_alone_do_not_pick_a_version():
    # V3, R1, V3.1 and later share the special tokens; only the template tells the markups apart.
    sig = Signature("", TOKENS)
    assert not PARSER.detect(sig) and not V3.detect(sig)


def test_names_and_markers():
    assert (PARSER.name, PARSER.reasoning, V3.name, V3.reasoning) == ("deepseek_v31", "deepseek_v3", "deepseek_v3",
                                                                      "deepseek_r1")
    assert {PARSER.reasoning, V3.reasoning} <= set(REASONING)
    assert CB in PARSER.markers and C in V3.markers


@pytest.mark.parametrize("path", [Path(__file__).parent / "qwen_template.jinja",
                                  *sorted(p for p in FAMILIES.glob("*.jinja") if p.name not in OWN)],
                         ids=lambda p: p.name)
def test_other_families_not_detected(path):
    sig = Signature(path.read_text(encoding="utf-8"))
    assert not PARSER.detect(sig) and not V3.detect(sig)
