"""Fold a session's calls, in call_index order, into chains of token-faithful turns.

A chain holds its tip's full sequence once (the last prompt followed by its sampled ids) and, per
member call, where that call's sampled ids start and their logprobs. With token-in/token-out prompts
the tip's full sequence *is* the merged trace, so the state is linear in the session's tokens instead
of keeping every prompt. The same fold serves both builders: per_request slices one trace per call out
of the chains, prefix_merging emits one trace per chain (see builders.py).

A call joins the chain whose tip full sequence is a token prefix of its prompt (longest tip first);
anything else starts a new chain with the reason it could not continue: the gateway's
``chain.break_reason`` when it gave one, otherwise one detected here (``BREAK_REASONS``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from schemas import CallRecorded

# Reasons detected here (the gateway may add its own, e.g. "compaction", "system_changed").
BREAK_REASONS = {
    "first_call": "the session's first call",
    "side_call": "a side call (title, quota check, ...): never merged",
    "resampled": "same prompt as an earlier call's (a retry or regeneration of that turn)",
    "retokenized": "extends an earlier prompt but not that call's sampled ids (re-tokenized or edited reply)",
    "not_prefix": "no chain tip is a prefix of the prompt (rewritten history, a new conversation)",
    "delta_unresolved": "prompt_delta refers to a call that is missing or shorter than claimed (call dropped)",
    "verify_failed": "a merged trace failed the placement check; its calls were re-emitted one trace each",
}
# Why a call has no trace (``Fold.dropped``), besides "delta_unresolved" and "verify_failed" above.
ERRORED = "error"  # the harness got an error for it (CallRecorded.error): nothing sampled, never trained on
# A later call resampled its prompt (gateway "retry", or "resampled" here): the harness discarded this
# completion, so it must not be trained with the advantage of the trajectory that continued without it.
REPLACED = "replaced"
# Sampled with settings other than the run's (gateway/sampling.py): its logprobs are not what the trainer
# recomputes, so its tokens stay as context and are never trained on.
SAMPLING_MISMATCH = "sampling_mismatch"


@dataclass(frozen=True)
class CallTokens:
    """The token data of one recorded call: all assembly needs, nothing of the request text."""

    event_id: str
    call_index: int
    prompt_ids: list[int] | None
    delta: tuple[int, int, list[int]] | None  # (base_call_index, base_len, suffix_ids)
    completion_ids: list[int]
    logprobs: list[float]
    policy_version: int = 0
    side_call: bool = False
    break_reason: str = ""  # the gateway's, if it declared one
    created_at: float = 0.0
    error: bool = False  # answered with an error (CallRecorded.error): counted for the session, never folded
    off_run_sampling: bool = False  # CallRecorded.sampling.matches_run is False: context only, never trained

    @classmethod
    def from_record(cls, call: CallRecorded) -> "CallTokens":
        d = call.prompt_delta
        return cls(
            event_id=call.event_id,
            call_index=call.call_index,
            prompt_ids=None if call.prompt_ids is None else list(call.prompt_ids),
            delta=None if d is None else (d.base_call_index, d.base_len, list(d.suffix_ids)),
            completion_ids=list(call.completion_ids),
            logprobs=list(call.completion_logprobs),
            policy_version=call.policy_version,
            side_call=call.side_call,
            break_reason=call.chain.break_reason,
            created_at=call.created_at,
            error=bool(call.error),
            off_run_sampling=call.sampling is not None and not call.sampling.matches_run,
        )

    def held_bytes(self) -> int:
        """About what this call takes in memory as the session stage caches it: a list slot (8 bytes) and
        an int object per token id (28 bytes, 32 as allocated), a slot and a float object per logprob."""
        ids = len(self.prompt_ids or ()) + (len(self.delta[2]) if self.delta else 0) + len(self.completion_ids)
        return 40 * ids + 32 * len(self.logprobs) + 400

    @property
    def prompt_len(self) -> int:
        if self.prompt_ids is not None:
            return len(self.prompt_ids)
        assert self.delta is not None
        return self.delta[1] + len(self.delta[2])

    def to_json(self) -> dict[str, Any]:
        """Compact JSON form, as kept in the streams' state tables."""
        return {
            "e": self.event_id, "i": self.call_index, "p": self.prompt_ids,
            "d": None if self.delta is None else list(self.delta),
            "c": self.completion_ids, "l": self.logprobs, "v": self.policy_version,
            "s": self.side_call, "r": self.break_reason, "t": self.created_at,
            **({"x": True} if self.error else {}),  # only when set: older state stays byte-identical
            **({"o": True} if self.off_run_sampling else {}),
        }

    @classmethod
    def from_json(cls, o: dict[str, Any]) -> "CallTokens":
        d = o["d"]
        return cls(
            event_id=o["e"], call_index=o["i"], prompt_ids=o["p"],
            delta=None if d is None else (int(d[0]), int(d[1]), list(d[2])),
            completion_ids=o["c"], logprobs=o["l"], policy_version=o["v"],
            side_call=o["s"], break_reason=o["r"], created_at=o["t"], error=bool(o.get("x", False)),
            off_run_sampling=bool(o.get("o", False)),
        )


@dataclass
class Member:
    """One call inside a chain: its sampled ids are chain.tokens[start:start+len(logprobs)]."""

    call_index: int
    start: int
    logprobs: list[float]
    policy_version: int
    replaced: bool = False  # resampled by a later call, or sampled off the run's settings: never trained

    @property
    def end(self) -> int:
        return self.start + len(self.logprobs)


@dataclass
class Chain:
    tokens: list[int]  # the tip's full sequence: the merged trace's token ids
    tip_prompt_len: int
    members: list[Member]
    break_reason: str  # why this chain did not continue an earlier one
    side_call: bool = False


@dataclass
class Fold:
    """Running state of one session's assembly."""

    chains: list[Chain] = field(default_factory=list)
    where: dict[int, tuple[int, int]] = field(default_factory=dict)  # call_index -> (chain, end of its full sequence)
    breaks: Counter = field(default_factory=Counter)  # reason -> count (a new chain other than the first)
    dropped: dict[int, str] = field(default_factory=dict)  # call_index -> reason it has no trace
    merged: int = 0  # calls that continued an existing chain
    last_index: int = -1

    def full_sequence(self, call_index: int) -> list[int] | None:
        """Prompt + sampled ids of an earlier call, sliced out of its chain."""
        loc = self.where.get(call_index)
        if loc is None:
            return None
        chain, end = loc
        return self.chains[chain].tokens[:end]


def _resolve_prompt(fold: Fold, call: CallTokens) -> list[int] | None:
    if call.prompt_ids is not None:
        return list(call.prompt_ids)
    assert call.delta is not None
    base_index, base_len, suffix = call.delta
    base = fold.full_sequence(base_index)
    if base is None or base_len > len(base):
        return None
    return [*base[:base_len], *suffix]


def _tip_is_base(fold: Fold, chain_no: int, call: CallTokens) -> bool:
    """True when the prompt is, by its delta encoding, this chain's tip sequence plus a suffix."""
    if call.delta is None:
        return False
    base_index, base_len, _ = call.delta
    return fold.where.get(base_index) == (chain_no, base_len) and base_len == len(fold.chains[chain_no].tokens)


def _find_chain(fold: Fold, call: CallTokens, prompt: list[int]) -> int | None:
    """Index of the longest chain whose tip full sequence is a prefix of ``prompt``."""
    n = len(prompt)
    candidates = sorted(
        (i for i, c in enumerate(fold.chains) if not c.side_call and len(c.tokens) <= n),
        key=lambda i: -len(fold.chains[i].tokens),
    )
    for i in candidates:
        tokens = fold.chains[i].tokens
        # The delta fast path skips an O(T) comparison in the common case: a prompt encoded against
        # exactly the tip it extends.
        if _tip_is_base(fold, i, call) or prompt[: len(tokens)] == tokens:
            return i
    return None


def _has_main_chain(fold: Fold) -> bool:
    return any(not c.side_call for c in fold.chains)


def _detect_reason(fold: Fold, prompt: list[int]) -> str:
    if not _has_main_chain(fold):
        return "first_call"
    for c in fold.chains:
        if c.side_call:
            continue
        tip_prompt = c.tokens[: c.tip_prompt_len]
        if prompt == tip_prompt:
            return "resampled"
        if len(prompt) > len(tip_prompt) and prompt[: len(tip_prompt)] == tip_prompt:
            return "retokenized"
    return "not_prefix"


def _mark_replaced(fold: Fold, prompt: list[int]) -> None:
    """Mark the tip call of every main chain whose prompt is ``prompt`` as replaced (a resample of it).

    Whatever the gateway named the break ("retry") or nothing ("resampled" here), a main call with an
    earlier tip's exact prompt repeats that turn, and the session goes on from the new completion.
    """
    for c in fold.chains:
        tip = c.members[-1]
        if c.side_call or tip.replaced or c.tip_prompt_len != len(prompt) or c.tokens[: c.tip_prompt_len] != prompt:
            continue
        tip.replaced = True
        fold.dropped[tip.call_index] = REPLACED


def extend(fold: Fold, call: CallTokens) -> Fold:
    """Add the next call of the session (call_index ascending) to the fold, in place; returns it.

    Calls must come in ascending call_index order without duplicates (the session buffer ensures
    that); a call whose prompt cannot be resolved is recorded in ``fold.dropped``, never guessed at.
    """
    if call.call_index <= fold.last_index:
        raise ValueError(f"call {call.call_index} folded after call {fold.last_index}: calls must ascend")
    fold.last_index = call.call_index
    if call.error:  # its prompt was never continued by the model (it may even exceed the context)
        fold.dropped[call.call_index] = ERRORED
        return fold
    tip = _extended_tip(fold, call)
    if tip is not None:  # the usual extending call: its prompt is never built as a list of its own
        suffix = call.delta[2]
        chain = fold.chains[tip]
        member = _member(fold, call, len(chain.tokens) + len(suffix))
        _merge(fold, tip, member, suffix, call.completion_ids)
        return fold
    prompt = _resolve_prompt(fold, call)
    if prompt is None:
        fold.dropped[call.call_index] = "delta_unresolved"
        fold.breaks["delta_unresolved"] += 1
        return fold
    member = _member(fold, call, len(prompt))
    target = None if call.side_call else _find_chain(fold, call, prompt)
    if target is not None:  # the interstitial (tool results, template glue), then the sampled ids
        _merge(fold, target, member, prompt[len(fold.chains[target].tokens):], call.completion_ids)
    else:
        reason = "side_call" if call.side_call else (call.break_reason or _detect_reason(fold, prompt))
        if not call.side_call and _has_main_chain(fold):
            fold.breaks[reason] += 1
        if not call.side_call:
            _mark_replaced(fold, prompt)
        prompt.extend(call.completion_ids)
        fold.chains.append(Chain(prompt, member.start, [member], reason, call.side_call))
        fold.where[call.call_index] = (len(fold.chains) - 1, len(prompt))
    return fold


def _extended_tip(fold: Fold, call: CallTokens) -> int | None:
    """The chain whose tip the call's delta encoding extends, when that is the chain ``_find_chain``
    would pick: no other main chain is long enough to be tried first. Then the merge needs only the
    suffix, where building the prompt copied the whole sequence three times per call (O(T^2) a session)."""
    if call.delta is None or call.side_call:
        return None
    base_index, base_len, suffix = call.delta
    loc = fold.where.get(base_index)
    if loc is None or loc[1] != base_len:
        return None
    chain = fold.chains[loc[0]]
    if chain.side_call or len(chain.tokens) != base_len:
        return None
    longest = base_len + len(suffix)
    if any(c is not chain and not c.side_call and base_len <= len(c.tokens) <= longest for c in fold.chains):
        return None
    return loc[0]


def _member(fold: Fold, call: CallTokens, prompt_len: int) -> Member:
    member = Member(call.call_index, prompt_len, list(call.logprobs), call.policy_version)
    if call.off_run_sampling:  # kept as context (later calls build on it), never trained on
        member.replaced = True
        fold.dropped[call.call_index] = SAMPLING_MISMATCH
    return member


def _merge(fold: Fold, target: int, member: Member, appended: list[int], completion: list[int]) -> None:
    """Continue chain ``target`` with the ids appended to its tip's sequence and the call's sampled ids."""
    chain = fold.chains[target]
    chain.tokens.extend(appended)
    chain.tip_prompt_len = member.start
    chain.tokens.extend(completion)
    chain.members.append(member)
    fold.merged += 1
    fold.where[member.call_index] = (target, len(chain.tokens))


def fold_calls(calls: list[CallTokens]) -> Fold:
    """Fold a session's calls (any order; sorted here) into chains."""
    fold = Fold()
    for call in sorted(calls, key=lambda c: c.call_index):
        extend(fold, call)
    return fold


def state_bytes(fold: Fold) -> int:
    """Rough in-memory size of a fold, counting 8 bytes per token id and logprob."""
    tokens = sum(len(c.tokens) for c in fold.chains)
    logprobs = sum(len(m.logprobs) for c in fold.chains for m in c.members)
    return 8 * (tokens + logprobs) + 64 * len(fold.where)
