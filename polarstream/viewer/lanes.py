"""A session's calls as lanes (one per chain), and a chain's tokens as coloured spans.

The chains are the stream processors' own: the calls are folded with streams/assembly.py, the code that
builds the traces trained on, so a lane here is exactly one prefix-merged trace there, and a break is
drawn with the reason assembly gives it (the gateway's ``chain.break_reason`` when it named one).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from schemas import CallRecorded
from streams.assembly import CallTokens, Chain, Fold, fold_calls


@dataclass(frozen=True)
class Row:
    """One call of the session page."""

    call: CallRecorded
    lane: int | None  # the chain it is in; None when it has no trace (an error, a missing delta base)
    starts_lane: bool  # the first call of its chain: the break is drawn here
    note: str  # break reason when it starts a lane, why it has no trace, "replaced" for a resampled turn


@dataclass(frozen=True)
class SessionLanes:
    rows: list[Row]
    chains: list[Chain]

    @property
    def breaks(self) -> list[str]:
        """Reasons of the chains after the first main one (what a user calls chain breaks)."""
        main = [c for c in self.chains if not c.side_call]
        return [c.break_reason for c in main[1:]]


def session_lanes(calls: Iterable[CallRecorded]) -> SessionLanes:
    """Fold the calls (any order) and say, per call, which lane it is on and why a lane starts."""
    ordered = sorted(calls, key=lambda c: c.call_index)
    fold: Fold = fold_calls([CallTokens.from_record(c) for c in ordered])
    rows = []
    for call in ordered:
        where = fold.where.get(call.call_index)
        dropped = fold.dropped.get(call.call_index, "")
        if where is None:
            rows.append(Row(call, None, False, dropped or "no trace"))
            continue
        chain = fold.chains[where[0]]
        starts = chain.members[0].call_index == call.call_index
        rows.append(Row(call, where[0], starts, chain.break_reason if starts else dropped))
    return SessionLanes(rows, fold.chains)


@dataclass(frozen=True)
class Span:
    """A run of a trace's tokens with one look: context or sampled, scrubbed or not."""

    start: int
    ids: list[int]
    sampled: bool
    logprobs: list[float]  # per id when sampled; empty for context
    scrubbed: bool
    call_index: int | None  # the call that sampled it (sampled spans only)


def chain_spans(chain: Chain, calls: dict[int, CallRecorded]) -> list[Span]:
    """The chain's tokens cut into spans: each member's sampled ids (with their logprobs) and the
    context between them, and the credential placeholders of every member's prompt (``scrubbed_spans``
    are ranges of a call's full prompt, which is a prefix of the chain's tokens)."""
    n = len(chain.tokens)
    sampled: list[tuple[int, float] | None] = [None] * n  # position -> (call_index, logprob)
    for m in chain.members:
        for i, lp in enumerate(m.logprobs):
            if m.start + i < n:
                sampled[m.start + i] = (m.call_index, lp)
    scrubbed = [False] * n
    for m in chain.members:
        call = calls.get(m.call_index)
        for a, b in (call.scrubbed_spans if call else []):
            for i in range(max(0, a), min(b, m.start, n)):
                scrubbed[i] = True
    spans: list[Span] = []
    i = 0
    while i < n:
        key = _look(sampled[i], scrubbed[i])
        j = i + 1
        while j < n and _look(sampled[j], scrubbed[j]) == key:
            j += 1
        is_sampled = sampled[i] is not None
        spans.append(Span(i, chain.tokens[i:j], is_sampled, [s[1] for s in sampled[i:j]] if is_sampled else [],  # type: ignore[index]
                          scrubbed[i], sampled[i][0] if is_sampled else None))  # type: ignore[index]
        i = j
    return spans


def _look(sampled: tuple[int, float] | None, scrubbed: bool) -> tuple:
    # Sampled runs split per call (each call's answer is its own span); context runs only at scrub edges.
    return (sampled[0] if sampled else None, scrubbed)
