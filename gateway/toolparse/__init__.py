"""Tool-call and reasoning parsers for the served model's raw completion text, one module per family.

The engine only ever sees and returns token ids; the gateway decodes them (special tokens kept) and
parses the text here. Parsers are named as vLLM names them (``--tool-call-parser``,
``--reasoning-parser``), so a user's serving flags carry over. The gateway picks them once, at start-up,
from the served tokenizer's chat template and special tokens (``choose``); ``--tool-parser`` and
``--reasoning-parser`` override the pick.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..canonical import Tool
from . import deepseek, glm45, harmony, hermes, kimi_k2, llama3, minimax_m2, mistral, think
from .base import NO_REASONING, ParsedOutput, ParserChoiceError, ReasoningParser, Signature, ToolParser, new_call_id
from .think import split_reasoning

__all__ = ["ParsedOutput", "ParserChoiceError", "Parsers", "Signature", "choose", "new_call_id",
           "parse_tool_calls", "split_reasoning", "TOOL_PARSERS", "REASONING_PARSERS"]

# Most specific first: the first whose markup the template shows is the pick (GLM-4.5's and Qwen3-Coder's
# templates also show Hermes' <tool_call>, so they come before hermes).
_TOOLS: list[ToolParser] = [harmony.PARSER, kimi_k2.PARSER, deepseek.PARSER, deepseek.V3, minimax_m2.PARSER,
                            glm45.PARSER, mistral.PARSER, llama3.PARSER, hermes.QWEN3_CODER, hermes.HERMES]
# Kimi-K2's own split also ends reasoning that runs into its tool-call section without a </think>
_REASONING: list[ReasoningParser] = [*(p for p in think.PARSERS if p.name != "kimi_k2"), kimi_k2.REASONING,
                                     harmony.REASONING, mistral.REASONING, NO_REASONING]

TOOL_PARSERS: dict[str, ToolParser] = {p.name: p for p in _TOOLS}
REASONING_PARSERS: dict[str, ReasoningParser] = {p.name: p for p in _REASONING}


@dataclass(frozen=True)
class Parsers:
    """The served model's tool-call and reasoning parsers."""

    tool: ToolParser = hermes.HERMES
    reasoning: ReasoningParser = REASONING_PARSERS["qwen3"]

    def parse(self, text: str, tools: list[Tool] | None = None) -> ParsedOutput:
        """Reasoning, text and tool calls of one decoded completion."""
        reasoning, rest = self.reasoning.split(text)
        out = self.tool.parse(rest, {t.name: t for t in tools or []})
        out.reasoning = reasoning
        return out

    def split_reasoning(self, text: str) -> tuple[str, str]:
        return self.reasoning.split(text)


def choose(sig: Signature, tool: str = "", reasoning: str = "") -> Parsers:
    """The parsers for a served model: the named ones, else the first family whose markup ``sig`` shows.
    Raises ParserChoiceError (one line naming the choices) for an unknown name or an unknown template."""
    if tool and tool not in TOOL_PARSERS:
        raise ParserChoiceError(f"unknown tool parser {tool!r}; choose one of {', '.join(TOOL_PARSERS)}")
    if reasoning and reasoning not in REASONING_PARSERS:
        raise ParserChoiceError(f"unknown reasoning parser {reasoning!r}; choose one of {', '.join(REASONING_PARSERS)}")
    picked = TOOL_PARSERS[tool] if tool else next((p for p in _TOOLS if p.detect(sig)), None)
    if picked is None:
        raise ParserChoiceError("the chat template shows no tool-call markup this gateway knows; name one with "
                                f"--tool-parser ({', '.join(TOOL_PARSERS)})")
    return Parsers(picked, REASONING_PARSERS[reasoning or picked.reasoning])


def parse_tool_calls(text: str, tools: list[Tool] | None = None) -> ParsedOutput:
    """Text and calls of Hermes / Qwen3-Coder markup (reasoning already removed): the built-in models' own."""
    return hermes.parse(text, {t.name: t for t in tools or []})
