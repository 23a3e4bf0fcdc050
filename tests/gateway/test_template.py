"""Chat template rendering, end-of-turn probing and the token-in/token-out bridge."""

import pytest

from gateway.canonical import Message, Tool, ToolCall
from gateway.template import ChatTemplate, TemplateError

SHELL = Tool(name="shell", description="run a command", parameters={"type": "object", "properties": {"command": {"type": "string"}}})


@pytest.fixture(scope="module")
def tpl(chat_tokenizer_dir) -> ChatTemplate:
    return ChatTemplate.load(str(chat_tokenizer_dir))


def _history():
    return [Message("system", "Be brief."), Message("user", "Create hello.txt containing hi")]


def test_end_of_turn_probed_from_template(tpl):
    assert tpl.eot.token == "<|im_end|>"
    assert tpl.eot.trailer == "\n"
    assert tpl.tokenizer.convert_ids_to_tokens(tpl.eot.token_id) == "<|im_end|>"


def test_prompt_renders_tools_and_generation_prompt(tpl):
    text = tpl.render_text(_history(), [SHELL])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "shell"' in text
    assert text.endswith("<|im_start|>user\nCreate hello.txt containing hi<|im_end|>\n<|im_start|>assistant\n")
    assert tpl.tokenizer.decode(tpl.prompt_ids(_history(), [SHELL])) == text


def test_assistant_tool_call_arguments_render_as_object(tpl):
    msgs = [*_history(), Message("assistant", tool_calls=[ToolCall("c1", "shell", '{"command": "ls"}')])]
    text = tpl.render_text(msgs, [SHELL], add_generation_prompt=False)
    assert '{"name": "shell", "arguments": {"command": "ls"}}' in text


def _sample(tpl, text: str, ended: bool = True) -> list[int]:
    return tpl.encode(text) + ([tpl.eot.token_id] if ended else [])


@pytest.mark.parametrize("ended", [True, False])
def test_bridge_extends_prompt_and_sampled_ids(tpl, ended):
    """prompt2 = prompt1 + sampled + bridge decodes to exactly the template's rendering of the new history."""
    history = _history()
    prompt1 = tpl.prompt_ids(history, [SHELL])
    sampled_text = '<tool_call>\n{"name": "shell", "arguments": {"command": "echo hi > hello.txt"}}\n</tool_call>'
    sampled = _sample(tpl, sampled_text, ended)
    assistant = Message("assistant", tool_calls=[ToolCall("c1", "shell", '{"command": "echo hi > hello.txt"}')])
    appended = [Message("tool", "done", tool_call_id="c1"), Message("user", "thanks")]
    bridge = tpl.bridge_ids([*history, assistant], appended, [SHELL], sampled)
    assert bridge is not None
    prompt2 = prompt1 + sampled + bridge
    assert prompt2[: len(prompt1) + len(sampled)] == prompt1 + sampled
    expected_text = tpl.render_text([*history, assistant, *appended], [SHELL])
    assert tpl.tokenizer.decode(prompt2) == expected_text
    assert bridge[0] != tpl.eot.token_id if ended else bridge[0] == tpl.eot.token_id


def test_a_template_that_rewrites_history_is_bridged_token_in_or_breaks_the_template_way(chat_tokenizer_dir):
    """A template that renders the message count up front changes the start of the text on every append:
    token-in keeps the tokens sent and bridges only the new turn; the template's way breaks the chain."""
    from gateway.template import ChainBreak, TurnHistory

    counting = "{{ messages|length }}:{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    hist = [Message("user", "a"), Message("assistant", "b")]
    tpl = ChatTemplate.load(str(chat_tokenizer_dir), chat_template=counting)
    bridge = tpl.bridge_ids(hist, [Message("user", "c")], [], _sample(tpl, "b"))
    assert tpl.tokenizer.decode(bridge) == "\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ChainBreak, match="template_not_append_only"):
        tpl.bridge_ids(hist, [Message("user", "c")], [], _sample(tpl, "b"), turns=TurnHistory("template"))


def test_decode_completion_drops_final_stop_token_only(tpl):
    ids = _sample(tpl, "<tool_call>\n{}\n</tool_call>")
    assert tpl.decode_completion(ids) == "<tool_call>\n{}\n</tool_call>"
    assert tpl.decode_completion(ids[:-1]) == "<tool_call>\n{}\n</tool_call>"


def test_template_exception_becomes_template_error(chat_tokenizer_dir):
    strict = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}" \
             "{% for m in messages %}{{ m.content }}<|im_end|>\n{% endfor %}"
    tpl = ChatTemplate.load(str(chat_tokenizer_dir), chat_template=strict)
    with pytest.raises(TemplateError, match="first message must be user"):
        tpl.prompt_ids([Message("assistant", "x")])


def test_segment_cache_gives_the_ids_of_whole_text_tokenization(tpl):
    """Fresh renders tokenize piecewise between added tokens; the ids must be whole-text ids, cached or not."""
    assert tpl.segments is not None
    tools = [SHELL, Tool("read", "Read a file " * 20, {"type": "object", "properties": {"path": {"type": "string"}}})]
    for task in ("Create hello.txt containing hi", "  Two spaces, then <b>markup</b> and trailing space ", "é ü 日本"):
        history = [Message("system", "You are a careful engineer. " * 20), Message("user", task),
                   Message("assistant", "ok", tool_calls=[ToolCall("c1", "shell", '{"command": "ls"}')]),
                   Message("tool", "a.txt\n\n  b.txt\n", tool_call_id="c1")]
        whole = tpl.encode(tpl.render_text(history, tools))
        hits = tpl.segments.hits
        assert tpl.prompt_ids(history, tools) == whole
        assert tpl.prompt_ids(history, tools) == whole  # now from the cache
        assert tpl.segments.hits > hits


def test_segment_cache_is_bounded_by_characters():
    from gateway.template import SegmentCache

    cache = SegmentCache(lambda texts: [[len(t)] for t in texts], {"<s>": 0}, max_chars=300, min_chars=10)
    for i in range(10):
        assert cache.encode(f"{i}" * 100 + "<s>" + "tail") == [100, 0, 4]
    assert len(cache) == 3  # 100-character pieces under a 300-character bound; "tail" is too short to keep
