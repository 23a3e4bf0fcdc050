"""Scripted-mode selection and rendering, the Hermes parser, message normalisation (no server)."""

import json

import pytest
from transformers import AutoTokenizer

from engine.protocol import EngineError
from engine.responses import parse_hermes
from engine.script import Script, ScriptError, parse_chatml, render_turn
from engine.serving import normalize_messages


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_parse_chatml_counts_finished_assistant_turns(tok):
    msgs = [{"role": "user", "content": "make a file"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": {"p": 1}}}]},
            {"role": "tool", "content": "written"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    k, last = parse_chatml(prompt)
    assert k == 1 and last == "<tool_response>\nwritten\n</tool_response>"
    assert parse_chatml(tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=False)) == (0, "make a file")


def test_skip_system_matches_past_a_harness_reminder(tok, tmp_path):
    # Claude Code puts system messages (agent lists, "file was modified" notes) after a tool result
    prompt = ("<|im_start|>system\nYou are an agent.<|im_end|>\n<|im_start|>user\ngo<|im_end|>\n"
              "<|im_start|>assistant\ncalling<|im_end|>\n<|im_start|>user\n<tool_response>\nstep01\n</tool_response><|im_end|>\n"
              "<|im_start|>system\nNote: a file was modified.<|im_end|>\n<|im_start|>assistant\n")
    assert parse_chatml(prompt) == (1, "Note: a file was modified.")
    assert parse_chatml(prompt, skip_system=True) == (1, "<tool_response>\nstep01\n</tool_response>")
    path = tmp_path / "s.yaml"
    path.write_text("turns: [{match: step01, text: Two.}]\nfallback: {text: Other.}\n")
    assert Script.load(path, tok).choose(prompt) == "Other."
    path.write_text("skip_system: true\nturns: [{match: step01, text: Two.}]\nfallback: {text: Other.}\n")
    assert Script.load(path, tok).choose(prompt) == "Two."
    path.write_text("skip_system: 1\nturns: [Two.]\n")
    with pytest.raises(ScriptError, match="skip_system"):
        Script.load(path, tok)


def test_render_turn_is_the_templates_own_markup(tok):
    body = render_turn(tok, "Writing it.", [{"name": "write_file", "arguments": {"path": "a.txt", "content": "hi"}}])
    assert body == 'Writing it.\n<tool_call>\n{"name": "write_file", "arguments": {"path": "a.txt", "content": "hi"}}\n</tool_call>'
    # and the template renders that same assistant message identically inside a conversation
    msgs = [{"role": "user", "content": "."}, {"role": "assistant", "content": "Writing it.", "tool_calls": [
        {"type": "function", "function": {"name": "write_file", "arguments": {"path": "a.txt", "content": "hi"}}}]}]
    assert "<|im_start|>assistant\n" + body + "<|im_end|>" in tok.apply_chat_template(msgs, tokenize=False)


def test_script_choice_in_order_by_match_and_fallback(tok, tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(
        "turns:\n"
        "  - tool_calls: [{name: write_file, arguments: {path: hello.txt, content: hi}}]\n"
        "  - text: All done.\n"
        "  - match: 'Traceback|error'\n"
        "    text: Something failed.\n"
        "fallback: {text: Nothing more to do.}\n")
    s = Script.load(path, tok)
    conv = [{"role": "user", "content": "write hello"}]
    render = lambda m: tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)  # noqa: E731
    assert s.choose(render(conv)).startswith("<tool_call>")
    conv += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "fine"}]
    assert s.choose(render(conv)) == "All done."
    assert s.choose(render(conv[:-1] + [{"role": "user", "content": "got an error"}])) == "Something failed."
    conv += [{"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}]
    assert s.choose(render(conv)) == "Nothing more to do."


def test_script_without_fallback_lets_the_model_sample(tok, tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("- Only turn.\n")
    s = Script.load(path, tok)
    two = "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n"
    assert s.choose(two) is None


@pytest.mark.parametrize("content, error", [
    ("turns: []\n", "non-empty 'turns'"),
    ("turns: [{txt: hi}]\n", "unknown keys ['txt']"),
    ("turns: [{match: '(', text: hi}]\n", "bad match regex"),
    ("turns: [{tool_calls: [{arguments: {}}]}]\n", "tool_calls[0]"),
    ("turns: [{raw: x, text: y}]\n", "'raw' excludes"),
    ("turns: [hi]\ndelay_s: -1\n", "delay_s must be a number of seconds"),
    ("turns: [hi]\ndelay_s: soon\n", "delay_s must be a number of seconds"),
])
def test_bad_scripts_name_the_problem(tok, tmp_path, content, error):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(ScriptError, match="bad.yaml") as e:
        Script.load(path, tok)
    assert error in str(e.value)


def test_hermes_parser_like_vllm():
    assert parse_hermes("plain text") == ("plain text", [])
    content, calls = parse_hermes('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": "é"}}\n</tool_call>'
                                  '\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')
    assert content == "Sure.\n"
    assert [c["function"]["name"] for c in calls] == ["f", "g"]
    assert calls[0]["function"]["arguments"] == '{"a": "é"}' and calls[0]["id"].startswith("chatcmpl-tool-")
    assert parse_hermes('<tool_call>\n{"name": "f", "arguments": {}}')[0] is None  # unterminated still parses
    assert parse_hermes("<tool_call>\nnot json\n</tool_call>") == ("<tool_call>\nnot json\n</tool_call>", [])


def test_normalize_messages_like_vllm():
    out = normalize_messages([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"x": 1})}},
            {"id": "2", "type": "function", "function": {"name": "g", "arguments": "{broken"}}]},
    ])
    assert out[0]["content"] == "a\nb" and out[1]["content"] == ""
    assert [c["function"]["arguments"] for c in out[1]["tool_calls"]] == [{"x": 1}, {}]
    with pytest.raises(EngineError):
        normalize_messages([{"content": "no role"}])


def test_delay_s_is_read_and_defaults_to_none(tok, tmp_path):
    path = tmp_path / "slow.yaml"
    path.write_text("turns: [hi]\ndelay_s: 2.5\n")
    assert Script.load(path, tok).delay_s == 2.5
    path.write_text("turns: [hi]\n")
    assert Script.load(path, tok).delay_s == 0.0
