"""Token-exact turns for every model family (issue 51): a 6-call agent session (tool calls with reasoning,
tool results, a final answer, a new user turn, more calls) planned through the gateway's own
``plan_prompt`` on each family's fixture (its published template and special tokens, tests/gateway/families).

- ``sampled`` (token-in, the default): every call extends the previous one; its prompt is the previous
  prompt + the sampled ids + a bridge that is the template's own rendering of the new messages.
- ``template``: a call extends only where that equals the template's rendering of the whole history;
  where the template renders a turn differently than the model wrote it, the chain breaks with the
  reason this family's template gives.
"""

import json

import pytest

from gateway.canonical import ChatRequest, Message, Tool
from gateway.sessions import Turn
from gateway.template import ChatTemplate, TurnHistory
from gateway.tokens import plan_prompt
from gateway.toolparse import choose
from tests.gateway.families import FAMILIES, family_dir

SHELL = Tool("shell", "Run a command.", {"type": "object", "properties": {"command": {"type": "string"}}})


def _args(command: str) -> str:
    return json.dumps({"command": command})


# What each family's model writes: a tool call and a final answer, each with its reasoning where the
# family has reasoning markup, and the token it stops at.
WRITES = {
    "harmony": (lambda r, c: ("<|channel|>analysis<|message|>" + r + "<|end|><|start|>assistant<|channel|>commentary "
                              "to=functions.shell <|constrain|>json<|message|>" + _args(c), "<|call|>"),
                lambda r, t: ("<|channel|>analysis<|message|>" + r + "<|end|><|start|>assistant<|channel|>final"
                              "<|message|>" + t, "<|return|>")),
    "llama3": (lambda r, c: ('{"name": "shell", "parameters": ' + _args(c) + "}", "<|eot_id|>"),
               lambda r, t: (t, "<|eot_id|>")),
    "glm45": (lambda r, c: (f"\n<think>{r}</think>\n<tool_call>shell\n<arg_key>command</arg_key>\n<arg_value>{c}"
                            "</arg_value>\n</tool_call>", "<|observation|>"),
              lambda r, t: (f"\n<think>{r}</think>\n{t}", "<|user|>")),
    "deepseek": (lambda r, c: ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>shell<｜tool▁sep｜>" + _args(c)
                               + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "<｜end▁of▁sentence｜>"),
                 lambda r, t: (t, "<｜end▁of▁sentence｜>")),
    "kimi_k2": (lambda r, c: ("<|tool_calls_section_begin|><|tool_call_begin|>functions.shell:0"
                              "<|tool_call_argument_begin|>" + _args(c) + "<|tool_call_end|><|tool_calls_section_end|>",
                              "<|im_end|>"),
                lambda r, t: (t, "<|im_end|>")),
    "mistral": (lambda r, c: (f"[THINK]{r}[/THINK][TOOL_CALLS]shell[ARGS]" + _args(c), "</s>"),
                lambda r, t: (f"[THINK]{r}[/THINK]{t}", "</s>")),
    "minimax_m2": (lambda r, c: (f'{r}\n</think>\n\n<minimax:tool_call>\n<invoke name="shell">\n<parameter '
                                 f'name="command">{c}</parameter>\n</invoke>\n</minimax:tool_call>', "[e~["),
                   lambda r, t: (f"{r}\n</think>\n\n{t}", "[e~[")),
}
SESSION = [("call", "ls"), ("call", "cat a.txt"), ("final", "a.txt says hi"), ("call", "ls | wc -l"),
           ("call", "wc a.txt"), ("final", "one file, 3 bytes")]
NEXT = [Message("tool", "a.txt"), Message("tool", "hi"), Message("user", "now count them"), Message("tool", "1"),
        Message("tool", "1 1 3 a.txt")]

# The template's way, per family: why each of calls 2-6 breaks ('' = it extends). The harness echoes the
# turn without its reasoning (as harnesses do), so a template that renders reasoning only from the echo
# drops it; DeepSeek's vLLM template indents the tokens of an earlier turn with spaces the model never wrote.
TEMPLATE_WAY = {
    "harmony": "template_drops_reasoning", "glm45": "template_drops_reasoning",
    "mistral": "template_drops_reasoning", "minimax_m2": "template_drops_reasoning",
    "deepseek": "template_rewrites_turn", "llama3": "", "kimi_k2": "",
}


def _session(family: str, history: str) -> list[str]:
    """Run SESSION through plan_prompt; each call's break_reason (checking every extension token-exact)."""
    tpl = ChatTemplate.load(str(family_dir(family)))
    parsers = choose(tpl.signature())
    turns = TurnHistory(history, parsers.split_reasoning)
    call, final = WRITES[family]
    msgs = [Message("system", "Be brief."), Message("user", "what is in a.txt?")]
    prev, reasons = None, []
    for i, (kind, what) in enumerate(SESSION):
        req = ChatRequest(provider="openai.chat", model="m", messages=list(msgs), tools=[SHELL])
        plan = plan_prompt(tpl, prev, req, turns=turns)
        reasons.append(plan.break_reason)
        if prev is not None and not plan.break_reason:
            assert plan.prompt_ids[:len(prev.full_sequence)] == prev.full_sequence  # token-exact
            bridge = tpl.tokenizer.decode(plan.prompt_ids[len(prev.full_sequence):], skip_special_tokens=False)
            assert tpl.render_text(msgs, [SHELL]).endswith(bridge)  # the template's own glue
        text, stop = (call if kind == "call" else final)(f"thinking {i}", what)
        completion = [*tpl.encode(text), tpl.tokenizer.convert_tokens_to_ids(stop)]
        parsed = parsers.parse(tpl.decode_completion(completion), [SHELL])
        assert parsed.parse_error == "" and len(parsed.tool_calls) == (kind == "call"), (family, i, parsed)
        if kind == "call":
            assert json.loads(parsed.tool_calls[0].arguments) == {"command": what}
        prev = Turn(i, plan.prompt_ids, completion, list(msgs), [SHELL], parsed.text, parsed.tool_calls,
                    plan.extends_call_index, plan.break_reason)
        if i == len(NEXT):
            break
        after = NEXT[i]
        if after.role == "tool":  # the harness runs the tool and answers the call by its id
            after = Message("tool", after.content, tool_call_id=parsed.tool_calls[0].id, name="shell")
        msgs += [Message("assistant", parsed.text, tool_calls=parsed.tool_calls), after]
    return reasons


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_six_call_session_is_one_chain_token_in(family):
    assert _session(family, "sampled") == ["first_call"] + [""] * 5


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_template_way_extends_or_names_what_the_family_template_changed(family):
    assert _session(family, "template") == ["first_call"] + [TEMPLATE_WAY[family]] * 5


def test_every_family_has_writes_and_a_template_way_expectation():
    assert set(WRITES) == set(FAMILIES) == set(TEMPLATE_WAY)
