"""The gateway picks its tool-call and reasoning parsers from the served model's chat template and special
tokens (gateway/toolparse/__init__.py), as vLLM's flags name them; a name overrides the pick."""

from pathlib import Path

import pytest

from gateway.template import ChatTemplate
from gateway.toolparse import REASONING_PARSERS, TOOL_PARSERS, ParserChoiceError, Signature, choose

FAMILIES = Path(__file__).with_name("families")
# fixture -> (tool parser, reasoning parser): what vLLM serves that family's models with
EXPECTED = {
    "harmony": ("openai", "openai_gptoss"),
    "kimi_k2": ("kimi_k2", "kimi_k2"),
    "deepseek": ("deepseek_v31", "deepseek_v3"),
    "deepseek_v3": ("deepseek_v3", "deepseek_r1"),
    "minimax_m2": ("minimax_m2", "minimax_m2"),
    "glm45": ("glm45", "glm45"),
    "mistral": ("mistral", "mistral"),
    "llama3": ("llama3_json", "none"),
}


def test_every_family_fixture_has_an_expectation_and_a_source_line():
    fixtures = sorted(p.stem for p in FAMILIES.glob("*.jinja"))
    assert fixtures == sorted(EXPECTED)
    for name in fixtures:
        assert (FAMILIES / f"{name}.jinja").read_text().startswith("{#- source: "), name


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_auto_detection_picks_each_familys_parsers_from_its_published_template(family):
    picked = choose(Signature((FAMILIES / f"{family}.jinja").read_text()))
    assert (picked.tool.name, picked.reasoning.name) == EXPECTED[family]


def test_the_built_in_models_template_picks_hermes():
    from infra.models import ensure_model

    template = ChatTemplate.load(str(ensure_model("tiny")))
    picked = choose(template.signature())
    assert (picked.tool.name, picked.reasoning.name) == ("hermes", "qwen3")
    qwen = choose(Signature((Path(__file__).with_name("qwen_template.jinja")).read_text()))
    assert qwen.tool.name == "hermes"


def test_special_tokens_alone_show_a_family():
    sig = Signature("{{ messages }}", frozenset({"<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                                                 "<|tool_call_argument_begin|>"}))
    assert choose(sig).tool.name == "kimi_k2"


def test_an_unknown_template_is_refused_in_one_line_naming_every_choice():
    with pytest.raises(ParserChoiceError) as refused:
        choose(Signature("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"))
    said = str(refused.value)
    assert "\n" not in said and "--tool-parser" in said
    assert all(name in said for name in TOOL_PARSERS)


def test_names_override_the_pick_and_unknown_names_are_refused():
    glm = Signature((FAMILIES / "glm45.jinja").read_text())
    assert choose(glm, tool="hermes").tool.name == "hermes"
    assert choose(glm, tool="hermes").reasoning.name == "qwen3"  # the named family's own pairing
    assert choose(glm, reasoning="none").reasoning.name == "none"
    for kw, word in (({"tool": "glm4"}, "tool"), ({"reasoning": "think"}, "reasoning")):
        with pytest.raises(ParserChoiceError, match=f"unknown {word} parser"):
            choose(glm, **kw)
    assert set(REASONING_PARSERS) >= {"qwen3", "deepseek_r1", "openai_gptoss", "mistral", "none"}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_each_family_parses_a_call_through_its_chosen_parsers(family):
    """One call in each family's markup (as its model writes it) comes out as the same call."""
    import json

    from gateway.canonical import Tool

    calls = {
        "harmony": '<|channel|>analysis<|message|>list it<|end|><|start|>assistant<|channel|>commentary '
                   'to=functions.shell <|constrain|>json<|message|>{"command": "ls"}<|call|>',
        "kimi_k2": '<think>list it</think><|tool_calls_section_begin|><|tool_call_begin|>functions.shell:0'
                   '<|tool_call_argument_begin|>{"command": "ls"}<|tool_call_end|><|tool_calls_section_end|>',
        "deepseek": '<think>list it</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>shell<｜tool▁sep｜>'
                    '{"command": "ls"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "deepseek_v3": '<think>list it</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>shell\n'
                       '```json\n{"command": "ls"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "minimax_m2": 'list it</think>\n<minimax:tool_call>\n<invoke name="shell">\n<parameter name="command">ls'
                      '</parameter>\n</invoke>\n</minimax:tool_call>',
        "glm45": '<think>list it</think>\n<tool_call>shell\n<arg_key>command</arg_key>\n<arg_value>ls</arg_value>\n'
                 '</tool_call>',
        "mistral": '[THINK]list it[/THINK][TOOL_CALLS]shell[ARGS]{"command": "ls"}',
        "llama3": '<|python_tag|>{"name": "shell", "parameters": {"command": "ls"}}',
    }
    parsers = choose(Signature((FAMILIES / f"{family}.jinja").read_text()))
    shell = Tool("shell", "Run a command.", {"type": "object", "properties": {"command": {"type": "string"}}})
    out = parsers.parse(calls[family], [shell])
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("shell", {"command": "ls"})], out
    assert out.parse_error == "" and out.text == ""
    assert out.reasoning == ("" if family == "llama3" else "list it")
