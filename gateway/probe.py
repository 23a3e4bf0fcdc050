"""Refuse to serve when the gateway's tokenizer is not the engine's.

The gateway tokenizes every prompt itself (token-in/token-out) and decodes what the engine samples. With
another tokenizer than the engine's, every recorded id would mean something else to the model: the
engine would generate from garbage and the trainer learn from it, with nothing failing. At start-up the
gateway asks the engine (vLLM's and our engine's ``/tokenize`` and ``/detokenize``) to tokenize a probe
text and to decode ids spread over the vocabulary, up to the last one, and compares with its own.
"""

from __future__ import annotations

from typing import Any

# Code, prose, whitespace runs and several scripts: tokenizers that differ at all differ here.
PROBE_TEXT = ("def add(a, b):\n    return a + b  # the sum\n\n\tcafé naïve — 日本語 и русский 🙂 ~/.polar $HOME "
              "{\"k\": [1, 2.5e-3]} <div class='x'>ok</div>")


class TokenizerMismatch(RuntimeError):
    """The engine tokenizes or decodes differently from the gateway."""


class LogprobsModeMismatch(RuntimeError):
    """The engine reports logprobs of another distribution than the one it samples from."""


def check_logprobs_mode(mode: str, policy: Any) -> None:
    """Refuse an engine that reports raw logprobs when the run samples at another temperature or with
    truncation: every recorded logprob would then be of the wrong distribution. '' = not reported (vLLM:
    start it with ``--logprobs-mode processed_logprobs``; docs/gateway.md)."""
    if mode != "raw_logprobs":
        return
    if (policy.temperature, policy.top_p, policy.top_k) != (1.0, 1.0, 0):
        raise LogprobsModeMismatch(
            f"the engine returns raw_logprobs but the run samples at temperature {policy.temperature:g}, top_p "
            f"{policy.top_p:g}, top_k {policy.top_k}: start it with --logprobs-mode processed_logprobs")


def _probe_ids(vocab: int) -> list[int]:
    return sorted({0, 1, 2, vocab // 7, vocab // 3, vocab // 2, (2 * vocab) // 3, vocab - 2, vocab - 1})


async def check_tokenizer(tokenizer: Any, upstream: Any, served_model: str, gateway_model: str) -> str:
    """'' when the engine agrees with ``tokenizer``; a reason ('unverified: ...') when it cannot say.

    Raises TokenizerMismatch with one line naming both sides when they differ."""
    tokenize = getattr(upstream, "tokenize", None)
    if tokenizer is None or tokenize is None:
        return "unverified: no tokenizer or the engine client cannot tokenize"
    remote = await tokenize(PROBE_TEXT)
    if remote is None:
        return "unverified: the engine has no /tokenize"
    both = f"gateway tokenizer {gateway_model!r} ({len(tokenizer)} tokens) vs engine model {served_model!r}"
    local = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    if remote != local:
        first = next((i for i, (a, b) in enumerate(zip(local, remote)) if a != b), min(len(local), len(remote)))
        raise TokenizerMismatch(f"tokenizer mismatch: {both}: the probe text tokenizes to {len(local)} vs "
                                f"{len(remote)} ids, first difference at position {first}")
    if await upstream.detokenize(local) is None:
        return "unverified: the engine has no /detokenize (the probe text tokenized the same)"
    for i in _probe_ids(len(tokenizer)):
        theirs = await upstream.detokenize([i])
        if theirs is None:
            raise TokenizerMismatch(f"tokenizer mismatch: {both}: the engine does not know token id {i}")
        ours = tokenizer.decode([i])
        if theirs != ours:
            raise TokenizerMismatch(f"tokenizer mismatch: {both}: token id {i} is {ours!r} here, {theirs!r} there")
    return ""
