"""Token-in/token-out planning: extension of the previous call, echo matching, break reasons."""

import json

import pytest

from gateway.canonical import ChatRequest, Message, Tool, ToolCall
from gateway.sessions import Turn
from gateway.template import ChatTemplate
from gateway.tokens import divergence, echo_matches, plan_prompt

SHELL = Tool(name="shell", description="run", parameters={"type": "object", "properties": {"command": {"type": "string"}, "cwd": {"type": "string"}}})
ARGS = '{"command": "echo hi > hello.txt", "cwd": "/w"}'
SAMPLED = '<tool_call>\n{"name": "shell", "arguments": ' + ARGS + '}\n</tool_call>'


@pytest.fixture(scope="module")
def tpl(chat_tokenizer_dir) -> ChatTemplate:
    return ChatTemplate.load(str(chat_tokenizer_dir))


def _req(messages, tools=(SHELL,), **kw) -> ChatRequest:
    return ChatRequest(provider="openai.chat", model="m", messages=list(messages), tools=list(tools), **kw)


HISTORY = [Message("system", "Be brief."), Message("user", "Create hello.txt containing hi")]


def _first_turn(tpl) -> Turn:
    plan = plan_prompt(tpl, None, _req(HISTORY))
    assert plan.break_reason == "first_call" and plan.extends_call_index is None
    completion = tpl.encode(SAMPLED) + [tpl.eot.token_id]
    return Turn(0, plan.prompt_ids, completion, list(HISTORY), [SHELL], "", [ToolCall("call_1", "shell", ARGS)])


def test_second_prompt_extends_first_prompt_plus_sampled_ids_exactly(tpl):
    prev = _first_turn(tpl)
    echo = Message("assistant", tool_calls=[ToolCall("call_1", "shell", ARGS)])
    req2 = _req([*HISTORY, echo, Message("tool", "done", tool_call_id="call_1")])
    plan = plan_prompt(tpl, prev, req2)
    assert plan.break_reason == "" and plan.extends_call_index == 0 and plan.history_offset == 2
    assert plan.prompt_ids[: len(prev.full_sequence)] == prev.full_sequence
    # The bridge is exactly the template's glue: the whole decodes to the template's rendering.
    assert tpl.tokenizer.decode(plan.prompt_ids) == tpl.render_text(req2.messages, req2.tools)


@pytest.mark.parametrize(
    "echoed",
    [
        ToolCall("call_1", "shell", '{"cwd":"/w","command":"echo hi > hello.txt"}'),  # re-ordered + compacted (qwen, Claude Code)
        ToolCall("run_shell_command_17_0", "shell", json.dumps({"command": "echo hi > hello.txt", "cwd": "/w"})),  # id replaced (Gemini CLI)
        ToolCall("", "shell", ARGS),  # id dropped (Responses via opencode/pi)
    ],
)
def test_imperfect_echoes_still_extend(tpl, echoed):
    prev = _first_turn(tpl)
    req2 = _req([*HISTORY, Message("assistant", tool_calls=[echoed]), Message("tool", "done", tool_call_id=echoed.id)])
    plan = plan_prompt(tpl, prev, req2)
    assert (plan.break_reason, plan.extends_call_index) == ("", 0)
    assert plan.prompt_ids[: len(prev.full_sequence)] == prev.full_sequence


def test_echo_with_changed_arguments_is_a_break(tpl):
    prev = _first_turn(tpl)
    edited = Message("assistant", tool_calls=[ToolCall("call_1", "shell", '{"command": "rm -rf /"}')])
    plan = plan_prompt(tpl, prev, _req([*HISTORY, edited, Message("tool", "x", tool_call_id="call_1")]))
    assert plan.break_reason == "assistant_turn_changed" and plan.extends_call_index is None
    assert plan.prompt_ids == tpl.prompt_ids([*HISTORY, edited, Message("tool", "x", tool_call_id="call_1")], [SHELL])


def test_text_echo_rules():
    calls = [ToolCall("a", "shell", "{}")]
    assert echo_matches(Message("assistant", " Hi there\n"), "Hi there", [])
    assert not echo_matches(Message("assistant", "Hi"), "Hi there", [])
    assert echo_matches(Message("assistant", "", tool_calls=calls), "Let me run it.", calls)  # text dropped
    assert not echo_matches(Message("user", "Hi there"), "Hi there", [])


@pytest.mark.parametrize(
    "mutate,reason",
    [
        (lambda m, t: (m, []), "tools_changed"),
        (lambda m, t: ([Message("system", "Other."), *m[1:]], t), "system_changed"),
        (lambda m, t: ([m[0], Message("user", "edited"), *m[2:]], t), "rewritten_history"),
        (lambda m, t: (m[:1], t), "history_shortened"),
        (lambda m, t: ([*m[:2], Message("tool", "done", tool_call_id="call_1")], t), "assistant_turn_missing"),
        (lambda m, t: (m[:3], t), "assistant_prefill"),
    ],
)
def test_break_reasons(tpl, mutate, reason):
    prev = _first_turn(tpl)
    base = [*HISTORY, Message("assistant", tool_calls=[ToolCall("call_1", "shell", ARGS)]), Message("tool", "done", tool_call_id="call_1")]
    msgs, tools = mutate(base, [SHELL])
    req = _req(msgs, tools)
    assert divergence(prev, req) == reason
    plan = plan_prompt(tpl, prev, req)
    assert plan.break_reason == reason and plan.extends_call_index is None


def test_retry_reuses_the_same_prompt_ids(tpl):
    prev = _first_turn(tpl)
    plan = plan_prompt(tpl, prev, _req(HISTORY))
    assert plan.prompt_ids == prev.prompt_ids
    assert (plan.break_reason, plan.extends_call_index) == ("retry", prev.extends_call_index)


def test_side_call_renders_afresh_regardless_of_chain(tpl):
    prev = _first_turn(tpl)
    side = _req([Message("system", "You are a title generator"), Message("user", "hi")], tools=[], side_call=True)
    plan = plan_prompt(tpl, prev, side)
    assert plan.break_reason == "side_call" and plan.extends_call_index is None


# ------------------------------------------------------------------------------ windowed bridges


def _long_session(tpl, turns: int, *, user_every: int = 0):
    """(prev Turn, request) for each extension of a session that runs ``turns`` tool calls; every
    ``user_every``-th turn appends a user message after the tool result."""
    history = [Message("system", "Be brief."), Message("user", "Fix the failing test in src/")]
    plan = plan_prompt(tpl, None, _req(history))
    prev, pairs = None, []
    for i in range(turns):
        args = json.dumps({"command": f"cat src/file_{i}.py", "cwd": "/w"})
        call = ToolCall(f"call_{i}", "shell", args)
        sampled = tpl.encode('<tool_call>\n{"name": "shell", "arguments": ' + args + "}\n</tool_call>") + [tpl.eot.token_id]
        prev = Turn(i, plan.prompt_ids, sampled, list(history), [SHELL], "", [call], plan.extends_call_index)
        history = [*history, Message("assistant", tool_calls=[call]), Message("tool", f"def f_{i}():\n    return {i}\n" * 5,
                                                                             tool_call_id=f"call_{i}")]
        if user_every and i % user_every == user_every - 1:
            history.append(Message("user", f"Also check case {i}."))
        req = _req(history)
        pairs.append((prev, req))
        plan = plan_prompt(tpl, prev, req)
    return pairs


@pytest.mark.parametrize("user_every", [0, 3])
def test_windowed_bridge_equals_the_full_render_at_every_call(tpl, user_every):
    from gateway.tokens import _bridge

    tpl.window_level = 2
    for prev, req in _long_session(tpl, 12, user_every=user_every):
        n = len(prev.messages)
        full = tpl.bridge_ids(req.messages[: n + 1], req.messages[n + 1 :], req.tools, prev.completion_ids)
        assert full is not None and _bridge(tpl, prev, req, check=False) == full
        plan = plan_prompt(tpl, prev, req)
        assert plan.prompt_ids == [*prev.full_sequence, *full] and plan.extends_call_index == prev.call_index
    assert tpl.window_level == 2  # this template's glue never needed the whole history


def test_a_template_whose_glue_reads_the_whole_history_falls_back_to_full_renders(chat_tokenizer_dir):
    # Numbers every turn: a window renders the appended turn with the wrong number.
    numbered = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ loop.index }}\n{{ m.content }}"
                "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tpl = ChatTemplate.load(str(chat_tokenizer_dir), chat_template=numbered)
    pairs = _long_session(tpl, 6)
    assert tpl.window_level == 0  # the chain's first extension is checked: both window levels disagreed
    for prev, req in pairs:
        n = len(prev.messages)
        full = tpl.bridge_ids(req.messages[: n + 1], req.messages[n + 1 :], req.tools, prev.completion_ids)
        assert plan_prompt(tpl, prev, req).prompt_ids == [*prev.full_sequence, *full]


def test_cheap_only_plans_windowed_extensions_and_leaves_whole_renders_to_the_caller(tpl):
    tpl.window_level = 2
    pairs = _long_session(tpl, 20)
    first_prev, first_req = pairs[0]
    assert plan_prompt(tpl, None, first_req, cheap_only=True) is None  # a first call renders everything
    assert plan_prompt(tpl, first_prev, first_req, cheap_only=True) is None  # the chain's first extension is checked
    cheap = 0
    for prev, req in pairs[3:]:
        plan = plan_prompt(tpl, prev, req, cheap_only=True)
        full = plan_prompt(tpl, prev, req)
        checked = (prev.call_index + 1) % 16 == 0  # tokens.WINDOW_CHECK_EVERY
        assert (plan is None) == checked, prev.call_index
        if plan is not None:  # the same plan as the whole render would give
            cheap += 1
            assert (plan.prompt_ids, plan.extends_call_index) == (full.prompt_ids, full.extends_call_index)
    assert cheap >= 15
    broken = _req([Message("system", "Other."), *first_req.messages[1:]])
    assert plan_prompt(tpl, first_prev, broken, cheap_only=True) is None  # a break renders afresh
    assert plan_prompt(tpl, first_prev, _req(first_prev.messages), cheap_only=True).break_reason == "retry"
