"""Recorded-looking sessions for tests, benches and demos, without a gateway.

Each session is what a token-in/token-out gateway records for a multi-turn agent: call k's prompt is
call k-1's prompt + its sampled ids + the interstitial (tool result, template glue), delta-encoded
against call k-1 like the gateway does. Optional twists: a side call, a compaction (history rewritten,
declared by the gateway), a re-tokenized turn (not declared: detected by assembly). Token ids come from
``tokenize`` (a real tokenizer's ``encode``) or from a seeded stand-in. Everything derives from the
seed, including event ids and times, so the same sessions can be published twice byte-identically.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from schemas import CallRecorded, ChainInfo, SessionEvent, encode_prompt, float32_digits, full_sequence

Tokenize = Callable[[str], list[int]]

_WORDS = "the file test passes fails edit read run def return import class value error line patch".split()

# ChatML (Qwen/Hermes style) pieces: with a real tokenizer the markers are single special tokens.
_SYSTEM = "<|im_start|>system\nYou are a coding agent. {}<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
_REPLY = '<tool_call>\n{{"name": "bash", "arguments": {{"command": "{}"}}}}\n</tool_call><|im_end|>'
_TOOL = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
_SIDE = "<|im_start|>user\nWrite a short title for: {}<|im_end|>\n<|im_start|>assistant\n"


def _fake_tokenize(text: str) -> list[int]:
    # Stable across processes (no hash()): a word's id is a small checksum of its bytes.
    return [3 + sum(w.encode()) * 31 % 8000 for w in text.split()]


@dataclass
class SessionSpec:
    session_id: str
    group_id: str
    sample_index: int = 0
    attempt: int = 0
    num_samples: int = 1
    min_valid: int = 1
    turns: int = 4
    status: str = "ok"
    reward: float | None = 1.0
    side_call_at: int | None = None  # insert a side call before this turn
    compaction_at: int | None = None  # rewrite the history before this turn (gateway-declared)
    retokenize_at: int | None = None  # re-tokenize the previous reply before this turn (undeclared)
    policy_version: int = 0
    tokens_per_turn: int = 12  # words per reply (and per piece below unless set)
    system_words: int | None = None  # the system prompt's size
    tool_words: int | None = None  # each tool result's size


@dataclass
class Recorded:
    calls: list[CallRecorded] = field(default_factory=list)
    finished: SessionEvent | None = None

    @property
    def records(self) -> list:
        return [*self.calls, self.finished]


def _logprob(x: float) -> float:
    """``x`` as the gateway records a logprob: computed in float32 by the engine, kept at float32's 9
    significant digits (schemas.float32_digits), not the 4 of a rounded stand-in that would flatter the
    bytes on every topic."""
    return float32_digits(struct.unpack("<f", struct.pack("<f", x))[0])


def _text(r: random.Random, n: int) -> str:
    return " ".join(r.choice(_WORDS) for _ in range(n))


def record_session(spec: SessionSpec, seed: int = 0, tokenize: Tokenize | None = None, t0: float = 1.7e9) -> Recorded:
    """The calls and finished event a gateway would record for ``spec``."""
    tok = tokenize or _fake_tokenize
    r = random.Random(f"{seed}/{spec.session_id}")
    n = spec.tokens_per_turn
    n_system = spec.system_words or n
    n_tool = spec.tool_words or n
    text = lambda k: _text(r, k)  # noqa: E731 - tiny local helper
    out = Recorded()
    prev_index: int | None = None  # the main conversation's latest call
    prev_seq: list[int] = []
    prev_prompt: list[int] = []
    call_index = 0
    clock = t0 + r.random()

    def add(prompt: list[int], side: bool, reason: str, extends: int | None) -> list[int]:
        nonlocal call_index, clock
        completion = tok(_REPLY.format(text(n)))
        delta = encode_prompt(prompt, prev_index, prev_seq) if (extends is not None and prev_index is not None) else None
        clock += 1.0 + r.random()
        out.calls.append(CallRecorded(
            event_id=f"{spec.session_id}-c{call_index}", created_at=round(clock, 3),
            session_id=spec.session_id, group_id=spec.group_id, task_id=spec.group_id,
            sample_index=spec.sample_index, attempt=spec.attempt, call_index=call_index,
            provider="openai.chat", policy_version=spec.policy_version, side_call=side,
            prompt_ids=None if delta else prompt, prompt_delta=delta,
            completion_ids=completion, completion_logprobs=[_logprob(-r.random() * 3) for _ in completion],
            finish_reason="stop", chain=ChainInfo(extends_call_index=extends, break_reason=reason),
        ))
        call_index += 1
        return completion

    task = text(2 * n)
    for turn in range(spec.turns):
        if spec.side_call_at == turn:
            add(tok(_SIDE.format(task)), True, "side_call", None)
        if turn == 0:
            prompt, reason, extends = tok(_SYSTEM.format(text(n_system), task)), "first_call", None
        elif spec.compaction_at == turn:
            summary = f"{task} Summary so far: {text(n)}"
            prompt, reason, extends = tok(_SYSTEM.format(text(n_system), summary)), "compaction", None
        elif spec.retokenize_at == turn:
            # The harness re-rendered the last reply from its text: same prompt head, different ids.
            reply = [t + 1 for t in prev_seq[len(prev_prompt):]]
            prompt, reason, extends = prev_prompt + reply + tok(_TOOL.format(text(n_tool))), "", None
        else:
            prompt, reason, extends = prev_seq + tok(_TOOL.format(text(n_tool))), "", prev_index
        completion = add(prompt, False, reason, extends)
        prev_index, prev_prompt, prev_seq = call_index - 1, prompt, full_sequence(prompt, completion)
    clock += 1.0
    out.finished = SessionEvent(
        event_id=f"{spec.session_id}-finished", created_at=round(clock, 3),
        session_id=spec.session_id, group_id=spec.group_id, task_id=spec.group_id,
        sample_index=spec.sample_index, attempt=spec.attempt, num_samples=spec.num_samples,
        min_valid=spec.min_valid, kind="finished", status=spec.status, reward=spec.reward,
        num_calls=len(out.calls),
    )
    return out


def record_group(group_id: str, rewards: list[float | None], seed: int = 0, tokenize: Tokenize | None = None,
                 statuses: list[str] | None = None, min_valid: int = 1, **spec_kw) -> list[Recorded]:
    """One recorded session per reward (None: no reward), as the samples of one group."""
    n = len(rewards)
    statuses = statuses or ["ok"] * n
    return [
        record_session(SessionSpec(f"{group_id}-s{i}", group_id, sample_index=i, num_samples=n, min_valid=min_valid,
                                   status=statuses[i], reward=rewards[i], **spec_kw), seed, tokenize)
        for i in range(n)
    ]
