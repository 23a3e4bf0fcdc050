"""Mistral's [TOOL_CALLS] markup (both shapes) and [THINK] reasoning (gateway/toolparse/mistral.py).

Model outputs marked "vLLM" come from vllm-project/vllm tests/tool_parsers/test_mistral_tool_parser.py.
"""

import json
from pathlib import Path

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.toolparse import Parsers, hermes, think
from gateway.toolparse.base import Signature
from gateway.toolparse.mistral import PARSER, REASONING

HERE = Path(__file__).parent
FIXTURE = HERE / "families" / "mistral.jinja"
OTHER_FIXTURES = [HERE / "qwen_template.jinja",
                  *sorted(p for p in (HERE / "families").glob("*.jinja") if p.name != "mistral.jinja")]
SPECIAL = frozenset({"<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                     "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]",
                     "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"})
MISTRAL = Parsers(PARSER, REASONING)


def calls(out):
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


def parse(text):
    return PARSER.parse(text, {})


# -- v11+ shape: [TOOL_CALLS]name[ARGS]{...} per call ---------------------------------------------------------------

def test_one_call():
    out = parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}')
    assert calls(out) == [("get_weather", {"city": "Paris"})]
    assert out.text == "" and out.parse_error == ""
    assert len(out.tool_calls[0].id) == 9 and out.tool_calls[0].id.isalnum()  # as Mistral templates require


def test_call_id_between_name_and_args_is_read_past():
    out = parse('[TOOL_CALLS]get_weather[CALL_ID]abc123456[ARGS]{"city": "Paris"}')
    assert calls(out) == [("get_weather", {"city": "Paris"})]
    assert out.parse_error == ""


def test_several_calls_with_end_of_turn_kept_or_not():
    raw = '[TOOL_CALLS]read[ARGS]{"path": "a.py"}[TOOL_CALLS]read[CALL_ID]Xy9Zz0001[ARGS]{"path": "b.py"}'
    for text in (raw, raw + "</s>"):
        out = parse(text)
        assert calls(out) == [("read", {"path": "a.py"}), ("read", {"path": "b.py"})]
        assert out.text == "" and out.parse_error == ""
        assert len({c.id for c in out.tool_calls}) == 2


def test_args_token_decoded_away():
    # vLLM ("single_tool_add", "multiple_tool_calls" of test_extract_tool_calls): its Mistral tokenizer drops [ARGS]
    out = parse('[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}')
    assert calls(out) == [("add_this_and_that", {"a": 3.5, "b": 4})]
    out = parse('[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}')
    assert calls(out) == [("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 3, "b": 6})]


def test_text_before_the_calls():
    out = parse('Let me look at both files.\n\n[TOOL_CALLS]read[ARGS]{"path": "a.py"}'
                '[TOOL_CALLS]read[ARGS]{"path": "b"}')
    assert out.text == "Let me look at both files."
    assert [c.name for c in out.tool_calls] == ["read", "read"]


def test_braces_and_escapes_in_text_and_arguments():
    # vLLM ("wrong_json" of test_extract_tool_calls)
    out = parse('hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')"}')
    assert out.text == "hi{hi"
    assert calls(out) == [("bash", {"command": "print(\"hello world!\")\nre.compile(r'{}')"})]
    assert out.parse_error == ""


def test_json_types_and_non_ascii_kept():
    out = parse('[TOOL_CALLS]shell[ARGS]{"command": "echo héllo", "timeout": 30, "background": false, '
                '"env": {"A": "1"}, "paths": ["x", "y"]}')
    assert calls(out) == [("shell", {"command": "echo héllo", "timeout": 30, "background": False, "env": {"A": "1"},
                                     "paths": ["x", "y"]})]
    assert "héllo" in out.tool_calls[0].arguments


def test_arguments_given_as_a_json_string():
    out = parse('[TOOL_CALLS]read[ARGS]"{\\"path\\": \\"a.py\\"}"')
    assert calls(out) == [("read", {"path": "a.py"})]


def test_text_after_a_call_stays_text():
    out = parse('[TOOL_CALLS]read[ARGS]{"path": "a.py"}\nThen I will edit it.')
    assert calls(out) == [("read", {"path": "a.py"})]
    assert out.text == "Then I will edit it."


def test_no_marker_is_plain_text():
    out = parse("The answer is {4}.")
    assert out.text == "The answer is {4}." and out.tool_calls == [] and out.parse_error == ""


# -- pre-v11 shape: [TOOL_CALLS][{"name": ..., "arguments": ...}, ...] ----------------------------------------------

def test_json_list_one_and_several():
    # vLLM ("single_tool_add", "multiple_tools" of test_extract_tool_calls_pre_v11_tokenizer)
    out = parse('[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]')
    assert calls(out) == [("add", {"a": 3.5, "b": 4})]
    out = parse('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "get_current_weather", '
                '"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}}]')
    assert calls(out) == [("add", {"a": 3.5, "b": 4}),
                          ("get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "celsius"})]
    assert out.parse_error == ""


def test_json_list_arguments_before_name_and_text_around():
    # vLLM ("argument_before_name_and_name_in_argument", "content_before_tool", "trailing_data_after_json")
    out = parse('[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]')
    assert calls(out) == [("get_age", {"name": "John Doe"})]
    out = parse('Hello[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]')
    assert out.text == "Hello" and calls(out) == [("add", {"a": 1, "b": 2})]
    out = parse('[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "Dallas", "state": "TX", '
                '"unit": "fahrenheit"}}]\nextra trailing data')
    assert calls(out) == [("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"})]
    assert out.text == "extra trailing data"


def test_json_list_with_ids_and_string_arguments():
    # what pre-v11 templates render for earlier turns: an "id" beside name and arguments
    out = parse('[TOOL_CALLS][{"name": "read", "arguments": "{\\"path\\": \\"a.py\\"}", "id": "abc123456"}]</s>')
    assert calls(out) == [("read", {"path": "a.py"})]
    assert out.parse_error == ""


# -- reasoning ------------------------------------------------------------------------------------------------------

def test_reasoning_then_call():
    out = MISTRAL.parse('[THINK]The user wants the weather; call the tool.[/THINK][TOOL_CALLS]get_weather[ARGS]'
                        '{"city": "Paris"}')
    assert out.reasoning == "The user wants the weather; call the tool."
    assert calls(out) == [("get_weather", {"city": "Paris"})]
    assert out.text == "" and out.parse_error == ""


def test_reasoning_then_answer():
    out = MISTRAL.parse("[THINK]2 + 2 = 4[/THINK]\n\nThe answer is 4.")
    assert (out.reasoning, out.text, out.tool_calls) == ("2 + 2 = 4", "The answer is 4.", [])


def test_without_reasoning():
    out = MISTRAL.parse('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}')
    assert out.reasoning == "" and out.text == "Checking."
    assert calls(out) == [("get_weather", {"city": "Paris"})]
    out = MISTRAL.parse("Just text, no thinking.")
    assert (out.reasoning, out.text) == ("", "Just text, no thinking.")


def test_reasoning_cut_off_is_all_reasoning():
    out = REASONING.split("[THINK]Let me think about [TOOL_CALLS] this")
    assert out == ("Let me think about [TOOL_CALLS] this", "")


def test_stray_end_of_thinking_is_dropped():
    assert REASONING.split("No opener here.[/THINK] Answer.") == ("", "No opener here. Answer.")


def test_text_before_thinking_is_kept():
    assert REASONING.split("Sure. [THINK]hmm[/THINK]Done.") == ("hmm", "Sure. Done.")


def test_think_tags_of_other_families_are_not_mistral_reasoning():
    assert REASONING.split("<think>x</think>y") == ("", "<think>x</think>y")


# -- malformed calls stay text, named in parse_error ----------------------------------------------------------------

def test_bad_json_stays_text_while_the_next_call_parses():
    raw = '[TOOL_CALLS]read[ARGS]{"path": }[TOOL_CALLS]read[ARGS]{"path": "b.py"}'
    out = parse(raw)
    assert calls(out) == [("read", {"path": "b.py"})]
    assert out.text == '[TOOL_CALLS]read[ARGS]{"path": }'
    assert "tool call 'read': arguments is not valid JSON" in out.parse_error


def test_bad_json_list_stays_text():
    raw = 'ok [TOOL_CALLS][{"name": "add", "arguments": {"a": 1,}}]'
    out = parse(raw)
    assert out.tool_calls == [] and out.text == raw
    assert "tool call list is not valid JSON" in out.parse_error


def test_missing_name():
    out = parse('[TOOL_CALLS][ARGS]{"a": 1}')
    assert out.tool_calls == [] and out.text == '[TOOL_CALLS][ARGS]{"a": 1}'
    assert "no function name" in out.parse_error
    out = parse('[TOOL_CALLS][{"arguments": {"a": 1}}]')
    assert out.tool_calls == [] and '"name"' in out.parse_error


def test_arguments_not_an_object():
    out = parse("[TOOL_CALLS]add[ARGS][1, 2]")
    assert out.tool_calls == [] and out.text == "[TOOL_CALLS]add[ARGS][1, 2]"
    assert "must be a JSON object" in out.parse_error
    out = parse("[TOOL_CALLS][]")
    assert out.tool_calls == [] and "empty" in out.parse_error


def test_unknown_shape():
    raw = "[TOOL_CALLS]I will now call the tool."
    out = parse(raw)
    assert out.tool_calls == [] and out.text == raw
    assert "neither a JSON list nor name[ARGS]" in out.parse_error


@pytest.mark.parametrize("raw", [
    'Reading.[TOOL_CALLS]read[ARGS]{"path": "a.p',  # in a string
    '[TOOL_CALLS]read[ARGS]{"path": "a.py", ',  # between members
    "[TOOL_CALLS]read[ARGS]",  # right after [ARGS]
    "[TOOL_CALLS]read[CALL_ID]abc12",  # in the call id
    "[TOOL_CALLS]toolname_no_args",  # vLLM (test_extract_tool_calls_v11_without_args_skipped)
    "[TOOL_CALLS]",
    '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1',  # the JSON-list shape
])
def test_truncated_generation(raw):
    out = parse(raw)
    assert out.tool_calls == [] and out.text == raw
    assert out.parse_error == "unterminated [TOOL_CALLS] call (generation stopped inside a tool call)"


def test_truncated_after_a_complete_call():
    # vLLM ("complex" of test_extract_tool_calls: the arguments' closing brace never came)
    out = parse('[TOOL_CALLS]read[ARGS]{"path": "a"}'
                '[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')"')
    assert calls(out) == [("read", {"path": "a"})]
    assert out.text.startswith("[TOOL_CALLS]bash{")
    assert "unterminated" in out.parse_error


def test_unclosed_json_before_another_call_is_invalid_not_truncated():
    out = parse('[TOOL_CALLS]read[ARGS]{"path": "a"[TOOL_CALLS]read[ARGS]{"path": "b"}')
    assert calls(out) == [("read", {"path": "b"})]
    assert "not valid JSON" in out.parse_error and "unterminated" not in out.parse_error


# -- the published template writes what the parser reads ------------------------------------------------------------

def _render(messages, tools=None):
    def raise_exception(msg):
        raise jinja2.TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    # transformers' tojson: json.dumps with its defaults (", " and ": ", keys in their order), non-ASCII kept
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(FIXTURE.read_text()).render(messages=messages, tools=tools, bos_token="<s>",
                                                       eos_token="</s>")


def test_template_rendering_of_a_turn_parses_back():
    params = {"type": "object", "properties": {"path": {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "read", "description": "Read a file", "parameters": params}}
    assistant = {"role": "assistant", "content": "Reading both.", "reasoning_content": "Need a.py and b.py.",
                 "tool_calls": [{"id": "call_" + "0" * 24, "type": "function",
                                 "function": {"name": "read", "arguments": {"path": "a.py", "n": 2}}},
                                {"id": "call_" + "1" * 24, "type": "function",
                                 "function": {"name": "read", "arguments": {"path": "b.py"}}}]}
    history = [{"role": "user", "content": "Show a.py and b.py"}, assistant,
               {"role": "tool", "tool_call_id": "call_" + "0" * 24, "content": "A"},
               {"role": "tool", "tool_call_id": "call_" + "1" * 24, "content": "B"}]
    text = _render(history, [tool])
    turn = text.split("[/INST]", 1)[1].split("[TOOL_RESULTS]", 1)[0]
    assert turn == ('[THINK]Need a.py and b.py.[/THINK]Reading both.[TOOL_CALLS]read[ARGS]{"path": "a.py", "n": 2}'
                    '[TOOL_CALLS]read[ARGS]{"path": "b.py"}</s>')
    out = MISTRAL.parse(turn)
    assert out.reasoning == "Need a.py and b.py." and out.text == "Reading both."
    assert calls(out) == [("read", {"path": "a.py", "n": 2}), ("read", {"path": "b.py"})]
    assert "call_" not in text  # this (v13) template renders no tool-call ids at all
    assert text.endswith("[TOOL_RESULTS]A[/TOOL_RESULTS][TOOL_RESULTS]B[/TOOL_RESULTS]")


# -- detection ------------------------------------------------------------------------------------------------------

def test_names():
    assert (PARSER.name, PARSER.reasoning, REASONING.name, PARSER.markers) == ("mistral", "mistral", "mistral",
                                                                               ("[TOOL_CALLS]",))


def test_detects_its_template_and_tokens():
    sig = Signature(FIXTURE.read_text(), SPECIAL)
    assert PARSER.detect(sig) and REASONING.detect(sig)
    assert PARSER.detect(Signature(FIXTURE.read_text()))
    assert PARSER.detect(Signature("", frozenset({"[TOOL_CALLS]", "[INST]"})))  # a template without tools, same tokens
    assert not hermes.HERMES.detect(sig) and not any(p.detect(sig) for p in think.PARSERS)


@pytest.mark.parametrize("path", OTHER_FIXTURES, ids=lambda p: p.name)
def test_other_families_templates_are_not_mistral(path):
    sig = Signature(path.read_text())
    assert not PARSER.detect(sig)
    assert not REASONING.detect(sig)


def test_call_ids_are_nine_letters_and_digits_as_mistral_templates_require():
    out = PARSER.parse('[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{"x": 1}', {})
    ids = [c.id for c in out.tool_calls]
    assert len(ids) == 2 and len(set(ids)) == 2
    assert all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids), ids
