"""Response bodies in vLLM 0.33's layouts (key order included) and the Hermes tool-call parser.

Besides vLLM's fields every body carries ``policy_version`` (top level): the version of the weights
that generated it. The same number is sent as the ``x-policy-version`` header.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from functools import lru_cache
from typing import Any

from .batcher import Sequence

LOGPROB_FLOOR = -9999.0  # vLLM sends -inf as this
SYSTEM_FINGERPRINT = "polarstream-engine"


def _lp(x: float) -> float:
    return max(x, LOGPROB_FLOOR)


class TokenText:
    """Decoded strings of single token ids, as vLLM shows them in logprobs (cached per id)."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self.as_ids = as_ids
        self._decode = lru_cache(maxsize=65536)(lambda i: tokenizer.decode([i], skip_special_tokens=False))

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self._decode(token_id)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None, "completion_tokens_details": None}


def weight_versions(seq: Sequence, version: int) -> list[dict[str, Any]]:
    # Weights never change under a running request (updates drain first), so one span covers it.
    return [{"version": str(version), "start": 0, "end": len(seq.token_ids)}]


# ------------------------------------------------------------------------------ completions


def completion_logprobs(seq: Sequence, text_of: TokenText) -> dict[str, Any]:
    """``choices[].logprobs`` of /v1/completions: text_offset, token_logprobs, tokens, top_logprobs."""
    tokens = [text_of(t) for t in seq.token_ids]
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    top = [{text_of(t): _lp(v) for t, v in entries} for entries in seq.top]
    return {"text_offset": offsets, "token_logprobs": [_lp(x) for x in seq.logprobs], "tokens": tokens, "top_logprobs": top}


def prompt_logprobs_body(scores: list | None, text_of: TokenText) -> list | None:
    """``choices[].prompt_logprobs``: ``[null, {"<id>": {logprob, rank, decoded_token}}, ...]`` (vLLM's)."""
    if scores is None:
        return None
    return [None if e is None else {str(t): {"logprob": _lp(v), "rank": r, "decoded_token": text_of(t)} for t, v, r in e}
            for e in scores]


def completion_body(request_id: str, model: str, results: list[tuple[list[int], list[Sequence], list | None]], *,
                    logprobs: bool, return_token_ids: bool, return_weight_versions: bool, text_of: TokenText,
                    policy_version: int) -> dict[str, Any]:
    """The /v1/completions body; ``results`` holds (prompt ids, its n sequences, its prompt scores or None) per
    prompt."""
    choices, n_prompt, n_out = [], 0, 0
    for prompt_ids, seqs, scores in results:
        n_prompt += len(prompt_ids)
        for seq in seqs:
            n_out += len(seq.token_ids)
            choices.append({
                "index": len(choices), "text": seq.text,
                "logprobs": completion_logprobs(seq, text_of) if logprobs else None,
                "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason,
                "token_ids": list(seq.token_ids) if return_token_ids else None,
                "prompt_logprobs": prompt_logprobs_body(scores, text_of),
                "prompt_token_ids": list(prompt_ids) if return_token_ids else None, "routed_experts": None,
                "weight_versions": weight_versions(seq, policy_version) if return_weight_versions else None,
            })
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage(n_prompt, n_out), "kv_transfer_params": None, "ec_transfer_params": None,
            "metrics": None, "policy_version": policy_version}


# ------------------------------------------------------------------------------ chat

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) as vLLM's ``hermes`` tool parser extracts them from a finished output.

    Content is the text before the first ``<tool_call>`` (None if empty); markup that does not parse
    as JSON leaves everything as content and no calls, exactly like vLLM.
    """
    if "<tool_call>" not in text:
        return text, []
    try:
        calls = [json.loads(a or b) for a, b in _TOOL_CALL.findall(text)]
        tool_calls = [{"id": f"chatcmpl-tool-{secrets.token_hex(8)}", "type": "function",
                       "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                      for c in calls]
    except (ValueError, KeyError, TypeError):
        return text, []
    content = text[: text.find("<tool_call>")]
    return content or None, tool_calls


def chat_logprobs(seq: Sequence, text_of: TokenText, k: int) -> dict[str, Any]:
    """``choices[].logprobs`` of chat: per token {token, logprob, bytes, top_logprobs[:k]}."""
    def entry(t: int, v: float) -> dict[str, Any]:
        s = text_of(t)
        return {"token": s, "logprob": _lp(v), "bytes": list(s.encode("utf-8"))}

    content = []
    for tok, lp, top in zip(seq.token_ids, seq.logprobs, seq.top):
        content.append({**entry(tok, lp), "top_logprobs": [entry(t, v) for t, v in top[:k]]})
    return {"content": content}


def chat_choice(index: int, seq: Sequence, *, parse_tools: bool, logprobs_k: int | None, return_token_ids: bool,
                return_weight_versions: bool, text_of: TokenText, policy_version: int) -> dict[str, Any]:
    content, calls = parse_hermes(seq.text) if parse_tools else (seq.text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None, "annotations": None,
                               "audio": None, "function_call": None, "tool_calls": calls, "reasoning": None}
    if not calls:
        del message["tool_calls"]
    finish = "tool_calls" if calls and seq.finish_reason == "stop" else seq.finish_reason
    return {"index": index, "message": message,
            "logprobs": chat_logprobs(seq, text_of, logprobs_k) if logprobs_k is not None else None,
            "finish_reason": finish, "stop_reason": seq.stop_reason,
            "token_ids": list(seq.token_ids) if return_token_ids else None, "routed_experts": None,
            "weight_versions": weight_versions(seq, policy_version) if return_weight_versions else None}


def chat_body(request_id: str, model: str, prompt_ids: list[int], choices: list[dict[str, Any]], completion_tokens: int,
              *, return_token_ids: bool, prompt_text: str | None, policy_version: int) -> dict[str, Any]:
    return {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage(len(prompt_ids), completion_tokens), "prompt_logprobs": None,
            "prompt_token_ids": list(prompt_ids) if return_token_ids else None, "prompt_text": prompt_text,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None, "policy_version": policy_version}
