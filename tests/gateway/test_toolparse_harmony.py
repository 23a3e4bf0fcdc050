"""OpenAI harmony (gpt-oss) tool-call and reasoning parsing: vLLM's ``openai`` / ``openai_gptoss``."""

import datetime
import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.canonical import Tool
from gateway.toolparse import Parsers
from gateway.toolparse.base import NO_REASONING, Signature
from gateway.toolparse.harmony import PARSER, REASONING, parse, split_reasoning

HERE = Path(__file__).parent
FIXTURE = HERE / "families" / "harmony.jinja"
SPECIAL = frozenset({"<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                     "<|constrain|>", "<|return|>", "<|call|>"})
WEATHER = Tool("get_weather", "Weather of a city.", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}, "required": ["city"]})
TOOLS = {"get_weather": WEATHER}
HARMONY = Parsers(PARSER, REASONING)

CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'


def calls(out):
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


def test_names_follow_vllm():
    assert (PARSER.name, PARSER.reasoning, REASONING.name) == ("openai", "openai_gptoss", "openai_gptoss")
    assert PARSER.markers == ("to=functions.",)


def test_one_call_with_and_without_its_call_token():
    for text in (CALL, CALL.removesuffix("<|call|>")):  # the engine drops the final stop token
        out = parse(text, TOOLS)
        assert calls(out) == [("get_weather", {"city": "Paris"})]
        assert out.text == "" and out.parse_error == ""
        assert out.tool_calls[0].id.startswith("call_")


def test_recipient_before_the_channel_as_the_template_renders_it():
    out = parse(' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo", "days": 3}<|call|>',
                TOOLS)
    assert calls(out) == [("get_weather", {"city": "Oslo", "days": 3})]
    out = parse('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}',
                TOOLS)
    assert calls(out) == [("get_weather", {"city": "Rome"})]


def test_several_calls_get_distinct_ids():
    text = "".join(f'<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                   f'{{"city": "c{i}"}}<|call|>' for i in range(3))
    out = parse(text.removeprefix("<|start|>assistant"), TOOLS)
    assert [args["city"] for _, args in calls(out)] == ["c0", "c1", "c2"]
    assert len({c.id for c in out.tool_calls}) == 3
    assert out.text == "" and out.parse_error == ""


def test_preamble_before_the_call_is_the_text():
    text = ("<|channel|>commentary<|message|>Let me check the weather.<|end|>"
            "<|start|>assistant" + CALL)
    out = parse(text, TOOLS)
    assert out.text == "Let me check the weather."
    assert calls(out) == [("get_weather", {"city": "Paris"})]


def test_final_answer_is_plain_text_without_control_tokens():
    answer = "<|channel|>final<|message|>The answer is 4."
    for text in (answer + "<|return|>", answer):
        out = HARMONY.parse(text, [WEATHER])
        assert (out.text, out.tool_calls, out.parse_error, out.reasoning) == ("The answer is 4.", [], "", "")


def test_reasoning_then_call():
    text = "<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant" + CALL
    out = HARMONY.parse(text, [WEATHER])
    assert out.reasoning == "Need the weather tool."
    assert calls(out) == [("get_weather", {"city": "Paris"})]
    assert out.text == "" and out.parse_error == ""


def test_reasoning_then_final_answer():
    text = ("<|channel|>analysis<|message|>2 and 2.<|end|><|start|>assistant<|channel|>analysis<|message|>Is 4.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>4<|return|>")
    out = HARMONY.parse(text, [])
    assert out.reasoning == "2 and 2.\nIs 4."
    assert out.text == "4" and out.tool_calls == [] and out.parse_error == ""
    assert "<|" not in out.text


def test_generation_cut_in_reasoning_is_reasoning():
    out = HARMONY.parse("<|channel|>analysis<|message|>Let me thi", [])
    assert (out.reasoning, out.text, out.parse_error) == ("Let me thi", "", "")


def test_split_keeps_the_rest_as_written():
    rest_in = "<|start|>assistant" + CALL
    reasoning, rest = split_reasoning("<|channel|>analysis<|message|>hmm<|end|>" + rest_in)
    assert (reasoning, rest) == ("hmm", rest_in)
    assert split_reasoning(CALL) == ("", CALL)  # no analysis: nothing taken
    # an analysis message with a recipient is a call, not reasoning
    addressed = '<|channel|>analysis to=functions.get_weather <|constrain|>json<|message|>{"city": "Bern"}<|call|>'
    assert split_reasoning(addressed) == ("", addressed)
    assert calls(HARMONY.parse(addressed, [WEATHER])) == [("get_weather", {"city": "Bern"})]


def test_tool_parser_alone_leaves_analysis_out_of_the_text():
    out = Parsers(PARSER, NO_REASONING).parse("<|channel|>analysis<|message|>secret<|end|><|start|>assistant"
                                              "<|channel|>final<|message|>Hi<|return|>", [])
    assert (out.text, out.reasoning) == ("Hi", "")


def test_plain_text_without_harmony_passes_through():
    out = HARMONY.parse("Just words.", [])
    assert (out.text, out.reasoning, out.parse_error) == ("Just words.", "", "")


def test_vllm_multiple_tools_case():
    # Messages from vllm-project/vllm tests/tool_use/test_openai_tool_parser.py
    # (test_extract_tool_calls_multiple_tools / _with_content), rendered as harmony text.
    text = ('<|channel|>analysis<|message|>User asks: "What is the weather in Tokyo?" based on their location. '
            "We need to use get_current_weather tool and get_user_location tool.<|end|>"
            '<|start|>assistant<|channel|>commentary to=functions.get_current_weather <|constrain|>json<|message|>'
            '{"location": "Tokyo"}<|call|>'
            '<|start|>assistant<|channel|>commentary to=functions.get_user_location <|constrain|>json<|message|>'
            '{\n"location": "Tokyo"\n}<|call|>'
            "<|start|>assistant<|channel|>commentary to=functions.no_content_type<|message|>"
            '{"location": "Tokyo"}<|call|>'
            "<|start|>assistant<|channel|>commentary to=functions.empty_args <|constrain|>json<|message|>{}<|call|>"
            "<|start|>assistant<|channel|>commentary to=functions.no_args <|constrain|>json<|message|><|call|>"
            "<|start|>assistant<|channel|>final<|message|>This tool call will get the weather.<|return|>")
    out = HARMONY.parse(text, [])
    assert calls(out) == [("get_current_weather", {"location": "Tokyo"}), ("get_user_location", {"location": "Tokyo"}),
                          ("no_content_type", {"location": "Tokyo"}), ("empty_args", {}), ("no_args", {})]
    assert out.text == "This tool call will get the weather."
    assert out.reasoning.startswith('User asks: "What is the weather')
    assert out.parse_error == ""


def test_arguments_keep_their_json_types_and_a_json_string_object_counts():
    out = parse('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                '{"city": "Lima", "days": 2, "metric": true}<|call|>', TOOLS)
    assert calls(out) == [("get_weather", {"city": "Lima", "days": 2, "metric": True})]
    # the chat template renders string arguments with tojson, so a model may echo them as a JSON string
    out = parse('<|channel|>commentary to=functions.get_weather json<|message|>"{\\"city\\": \\"Lima\\"}"<|call|>',
                TOOLS)
    assert calls(out) == [("get_weather", {"city": "Lima"})]


def test_bad_json_stays_text_while_the_good_call_beside_it_parses():
    bad = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
           '{"city": }<|call|>')
    out = parse(CALL + bad, TOOLS)
    assert calls(out) == [("get_weather", {"city": "Paris"})]
    assert out.text == bad
    assert "'get_weather': arguments is not valid JSON" in out.parse_error


def test_arguments_must_be_an_object():
    raw = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>["Paris"]<|call|>'
    out = parse(raw, TOOLS)
    assert out.tool_calls == [] and out.text == raw
    assert "must be a JSON object" in out.parse_error


def test_missing_function_name():
    raw = '<|channel|>commentary to=functions. <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    out = parse(raw, TOOLS)
    assert out.tool_calls == [] and out.text == raw
    assert "names no function" in out.parse_error


def test_generation_cut_inside_the_arguments_is_unterminated():
    raw = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Par'
    out = HARMONY.parse("<|channel|>analysis<|message|>go<|end|><|start|>assistant" + raw, [WEATHER])
    assert out.tool_calls == []
    assert out.text == "<|start|>assistant" + raw
    assert out.parse_error.startswith("unterminated tool call 'get_weather' (generation stopped inside a tool call")
    assert "unterminated" in parse(raw.split("<|message|>")[0] + "<|message|>", TOOLS).parse_error  # cut at once


def test_generation_cut_inside_the_header_is_unterminated():
    out = parse(CALL + "<|start|>assistant<|channel|>commentary to=functions.get_wea", TOOLS)
    assert calls(out) == [("get_weather", {"city": "Paris"})]
    assert out.text.endswith("to=functions.get_wea")
    assert "unterminated tool call" in out.parse_error and "header" in out.parse_error
    out = parse("<|channel|>final<|message|>Hi<|end|><|start|>assistant<|channel|>fin", TOOLS)
    assert out.text == "Hi\n<|start|>assistant<|channel|>fin"
    assert out.parse_error == "unterminated harmony message (generation stopped before <|message|>)"
    out = parse(CALL + "<|start|>", TOOLS)
    assert len(out.tool_calls) == 1 and out.text == "<|start|>"
    assert out.parse_error == "unterminated harmony message (generation stopped before <|message|>)"


def test_message_with_no_message_token():
    raw = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|call|>"
    out = parse(CALL + raw, TOOLS)
    assert len(out.tool_calls) == 1 and out.text == raw
    assert out.parse_error == "tool call 'get_weather' has no <|message|>"
    out = parse("<|channel|>final<|end|>", TOOLS)
    assert out.text == "<|channel|>final<|end|>" and "has no <|message|>" in out.parse_error


def test_unknown_shapes_stay_text():
    builtin = '<|channel|>analysis to=python<|message|>print(1)<|call|>'
    out = HARMONY.parse(builtin, [WEATHER])
    assert out.tool_calls == [] and out.text == builtin
    assert "'python' is not a function call" in out.parse_error
    fake_result = '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
    out = parse(CALL + fake_result, TOOLS)
    assert len(out.tool_calls) == 1 and out.text == fake_result
    assert "from 'functions.get_weather', not the assistant" in out.parse_error


def _render(messages, tools):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = lambda msg: (_ for _ in ()).throw(jinja2.TemplateError(msg))
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda x, **_: json.dumps(x, ensure_ascii=False)  # as transformers defines it
    return env.from_string(FIXTURE.read_text()).render(messages=messages, tools=tools, add_generation_prompt=True)


def test_fixture_renders_calls_in_a_shape_the_parser_reads():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                                "parameters": WEATHER.parameters}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "thinking": "Use the tool.",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    prompt = _render(msgs, tools)
    assert prompt.endswith('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
                           "<|start|>assistant")
    turn = prompt[prompt.index("<|start|>assistant<|channel|>analysis"):prompt.index("<|call|>") + len("<|call|>")]
    assert turn.endswith('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
                         '{"city": "Paris", "days": 2}<|call|>')
    out = HARMONY.parse(turn.removeprefix("<|start|>assistant"), [WEATHER])
    assert out.reasoning == "Use the tool."
    assert calls(out) == [("get_weather", {"city": "Paris", "days": 2})] and out.parse_error == ""


def test_detect_on_fixture_and_not_on_other_families():
    sig = Signature(FIXTURE.read_text(), SPECIAL)
    assert PARSER.detect(sig) and REASONING.detect(sig)
    assert PARSER.detect(Signature("", SPECIAL))  # the special tokens alone show it
    others = [HERE / "qwen_template.jinja", *sorted((HERE / "families").glob("*.jinja"))]
    for path in others:
        if path == FIXTURE or not path.exists():
            continue
        other = Signature(path.read_text())
        assert not PARSER.detect(other), path.name
        assert not REASONING.detect(other), path.name
