"""Traces from a folded session: per_request (one per call) or prefix_merging (one per chain).

Every trace is checked against the calls it came from before it leaves (``verify_trace``): each sampled
id and logprob must sit exactly once right after its own prompt, with mask 1 there and nowhere else.
A merged trace that fails is never emitted as is: its calls fall back to one trace each, marked
``verify_failed`` and counted; a call that fails even alone is dropped and counted.
A call whose prompt a later call resampled (a harness retry) is in no trace: the harness discarded its
completion, so it is dropped as ``replaced`` (see ``assembly.REPLACED``) under both builders.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from schemas import Trace

from .assembly import Chain, CallTokens, Fold, fold_calls

log = logging.getLogger(__name__)


@dataclass
class Assembled:
    """The traces of one session plus what happened on the way."""

    traces: list[Trace]
    breaks: Counter = field(default_factory=Counter)
    dropped: dict[int, str] = field(default_factory=dict)
    merged: int = 0
    side_calls_left_out: int = 0


def verify_trace(trace: Trace, calls: Mapping[int, CallTokens]) -> str:
    """'' when every sampled id/logprob of the trace's calls sits exactly once in place, else the problem."""
    n = len(trace.token_ids)
    if len(trace.loss_mask) != n or len(trace.logprobs) != n:
        return f"loss_mask/logprobs lengths {len(trace.loss_mask)}/{len(trace.logprobs)} differ from {n} tokens"
    prev_end = 0
    sampled = 0
    for idx in trace.call_indices:
        call = calls.get(idx)
        if call is None:
            return f"call {idx} is not among the session's calls"
        start, k = call.prompt_len, len(call.completion_ids)
        end = start + k
        if start < prev_end:
            return f"call {idx}'s sampled ids start at {start}, inside the previous call's (ends {prev_end})"
        if end > n:
            return f"call {idx}'s sampled ids end at {end}, past the trace's {n} tokens"
        if trace.token_ids[start:end] != call.completion_ids:
            return f"call {idx}'s sampled ids are not at [{start}:{end}]"
        if trace.logprobs[start:end] != call.logprobs:
            return f"call {idx}'s logprobs are not at [{start}:{end}]"
        if trace.loss_mask[start:end].count(1) != k:
            return f"call {idx}'s sampled ids are not all trainable"
        # Slice scans (C speed) over the gap before this call: any() is False only for all 0.0 / -0.0.
        if any(trace.logprobs[prev_end:start]):
            return f"a non-trainable token before call {idx} carries a logprob"
        prev_end, sampled = end, sampled + k
    if sum(trace.loss_mask) != sampled:
        return f"{sum(trace.loss_mask)} trainable tokens for {sampled} sampled ids"
    if any(trace.logprobs[prev_end:]):
        return "a non-trainable token after the last call carries a logprob"
    return ""


def _trace(chain: Chain, members, end: int, break_reason: str) -> Trace:
    """A trace over chain.tokens[:end] with the given members' sampled spans trainable."""
    mask = [0] * end
    logprobs = [0.0] * end
    for m in members:
        mask[m.start:m.end] = [1] * len(m.logprobs)
        logprobs[m.start:m.end] = m.logprobs
    # model_construct: the three lists have equal lengths by construction, and verify_trace checks
    # them before the trace leaves; validating here too doubled assembly time (docs/benchmarks.md).
    return Trace.model_construct(
        call_indices=[m.call_index for m in members],
        token_ids=chain.tokens[:end],
        loss_mask=mask,
        logprobs=logprobs,
        policy_versions=[m.policy_version for m in members],
        break_reason=break_reason,
        side_call=chain.side_call,
    )


def _per_call(chain: Chain, break_reason: str) -> list[Trace]:
    return [_trace(chain, [m], m.end, break_reason) for m in chain.members if not m.replaced]


def build_traces(fold: Fold, builder: str, side_calls: str = "trace") -> tuple[list[Trace], int]:
    """Unverified traces of a fold in call order; also how many side-call traces were left out."""
    out: list[tuple[int, Trace]] = []
    left_out = 0
    for chain in fold.chains:
        if chain.side_call and side_calls == "drop":
            left_out += len(chain.members)
            continue
        if builder == "prefix_merging":
            # A replaced (resampled) call is left out; the chain ends at its last kept call, so a
            # replaced tip's discarded completion is not even fed as context.
            kept = [m for m in chain.members if not m.replaced]
            if kept:
                out.append((kept[0].call_index, _trace(chain, kept, kept[-1].end, chain.break_reason)))
        elif builder == "per_request":
            reason = "side_call" if chain.side_call else ""
            out.extend((t.call_indices[0], t) for t in _per_call(chain, reason))
        else:
            raise ValueError(f"unknown builder {builder!r}; expected per_request or prefix_merging")
    out.sort(key=lambda p: p[0])
    return [t for _, t in out], left_out


def assemble(calls: Sequence[CallTokens], builder: str, side_calls: str = "trace", session: str = "") -> Assembled:
    """Fold a session's calls (any order; the first of a repeated call_index wins) into verified traces."""
    by_index: dict[int, CallTokens] = {}
    for c in calls:
        by_index.setdefault(c.call_index, c)
    return finish(fold_calls(list(by_index.values())), by_index, builder, side_calls, session)


def finish(fold: Fold, calls: Mapping[int, CallTokens], builder: str, side_calls: str = "trace", session: str = "") -> Assembled:
    """Build the traces of a fold and verify each against ``calls`` (call_index -> call)."""
    traces, left_out = build_traces(fold, builder, side_calls)
    result = Assembled([], Counter(fold.breaks), dict(fold.dropped), fold.merged, left_out)
    for trace in traces:
        problem = verify_trace(trace, calls)
        if not problem:
            result.traces.append(trace)
            continue
        log.error("session %s: trace of calls %s failed verification: %s", session, trace.call_indices, problem)
        result.breaks["verify_failed"] += 1
        for idx in trace.call_indices:
            single = _single_call_trace(fold, idx)
            if len(trace.call_indices) > 1 and not verify_trace(single, calls):
                result.traces.append(single)
            else:
                result.dropped[idx] = "verify_failed"
    result.traces.sort(key=lambda t: t.call_indices[0])
    return result


def _single_call_trace(fold: Fold, call_index: int) -> Trace:
    chain_no, _ = fold.where[call_index]
    chain = fold.chains[chain_no]
    member = next(m for m in chain.members if m.call_index == call_index)
    return _trace(chain, [member], member.end, "verify_failed")
