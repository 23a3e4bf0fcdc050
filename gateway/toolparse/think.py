"""``<think>...</think>`` reasoning: Qwen3, DeepSeek-R1 and V3.1, GLM-4.5, Kimi-K2, MiniMax-M2 (vLLM's
reasoning parsers ``qwen3``, ``deepseek_r1``, ``deepseek_v3``, ``glm45``, ``kimi_k2``, ``minimax_m2``
all read this markup; the names are kept so a user's vLLM flag works here unchanged)."""

from __future__ import annotations

from .base import ReasoningParser, Signature

OPEN, CLOSE = "<think>", "</think>"
NAMES = ("qwen3", "deepseek_r1", "deepseek_v3", "glm45", "kimi_k2", "minimax_m2")


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, rest): a leading ``<think>...</think>`` becomes reasoning.

    A ``</think>`` without an opening tag counts too: Qwen3-style templates put ``<think>`` into the
    generation prompt, so the completion starts inside the thinking block.
    """
    end = text.find(CLOSE)
    if end < 0:
        return "", text
    head = text[:end]
    start = head.find(OPEN)
    if start >= 0:
        if head[:start].strip():  # <think> after real text: not a leading block, leave as is
            return "", text
        head = head[start + len(OPEN):]
    return head.strip(), text[end + len(CLOSE):].lstrip("\n")


def _detect(sig: Signature) -> bool:
    return sig.has(CLOSE)


PARSERS = tuple(ReasoningParser(name, split_reasoning, _detect) for name in NAMES)
