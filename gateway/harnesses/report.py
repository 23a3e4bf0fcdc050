"""Merge rate per harness, measured from the recorded ``CallRecorded`` events (pure functions).

A session's main calls (side calls are separate chains by design) should form one chain: each prompt
is the previous main call's prompt + sampled ids + the appended tokens. The rate is checked on the
tokens themselves, independently of the gateway's own bookkeeping: a continuation (a main call after
the session's first answered one) counts as *merged* when its prompt ids start with the previous
main call's full sequence. Unmerged continuations are counted by the gateway's ``chain.break_reason``
(``unexplained`` when it gave none, which would be a gateway bug). ``gateway_agrees`` says whether the
gateway's ``chain.extends_call_index`` claims exactly the merges the tokens show.

Rows are keyed ``harness/provider`` (pi speaks four APIs); ``polarstream harness merge-report``
builds the table from a calls topic, and tests/harnesses/test_all_clis.py from its own run.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from schemas import CallRecorded


def full_prompts(calls: list[CallRecorded]) -> dict[int, list[int]]:
    """Prompt ids of each call of one session (deltas resolved); a call whose base is absent is left out."""
    prompts: dict[int, list[int]] = {}
    full: dict[int, list[int]] = {}  # prompt + completion: what a delta's base_len counts into
    for c in sorted(calls, key=lambda c: c.call_index):
        prompt = None
        if c.prompt_ids is not None:
            prompt = list(c.prompt_ids)
        elif c.prompt_delta is not None:
            d = c.prompt_delta
            base = full.get(d.base_call_index)
            if base is not None and d.base_len <= len(base):
                prompt = base[: d.base_len] + list(d.suffix_ids)
        if prompt is not None:
            prompts[c.call_index] = prompt
            full[c.call_index] = prompt + list(c.completion_ids)
    return prompts


def session_stats(calls: list[CallRecorded]) -> dict[str, Any]:
    """Counts of one session's calls (deduplicated by call_index, first copy wins)."""
    by_index: dict[int, CallRecorded] = {}
    for c in calls:
        by_index.setdefault(c.call_index, c)
    ordered = [by_index[i] for i in sorted(by_index)]
    prompts = full_prompts(ordered)
    out: dict[str, Any] = {"calls": len(ordered), "side_calls": 0, "failed_calls": 0, "parse_errors": 0,
                           "main_calls": 0, "continuations": 0, "merged": 0, "gateway_merged": 0,
                           "breaks": Counter(), "unresolved": 0}
    prev: CallRecorded | None = None
    for c in ordered:
        out["parse_errors"] += bool(c.output.parse_error)
        if c.error:  # answered with an error: nothing sampled, never a chain member
            out["failed_calls"] += 1
            continue
        if c.side_call:
            out["side_calls"] += 1
            continue
        out["main_calls"] += 1
        if prev is not None:
            out["continuations"] += 1
            prompt, base = prompts.get(c.call_index), prompts.get(prev.call_index)
            if prompt is None or base is None:
                out["unresolved"] += 1
            else:
                tip = base + list(prev.completion_ids)
                if prompt[: len(tip)] == tip and len(prompt) > len(tip):
                    out["merged"] += 1
                else:
                    out["breaks"][c.chain.break_reason or "unexplained"] += 1
            claimed = c.chain.extends_call_index == prev.call_index and c.chain.break_reason != "retry"
            out["gateway_merged"] += claimed
        prev = c
    return out


def label(calls: list[CallRecorded]) -> str:
    """``harness/provider`` of a session (its first call's; ``unknown`` when no harness was named)."""
    first = min(calls, key=lambda c: c.call_index)
    return f"{first.harness or 'unknown'}/{first.provider}"


def merge_report(calls: Iterable[CallRecorded]) -> dict[str, dict[str, Any]]:
    """Per ``harness/provider``: sessions, calls, side and failed calls, merge rate and break reasons."""
    sessions: dict[str, list[CallRecorded]] = defaultdict(list)
    seen: set[str] = set()
    for c in calls:
        if c.event_id not in seen:  # a re-delivered event is the same call
            seen.add(c.event_id)
            sessions[c.session_id].append(c)
    rows: dict[str, dict[str, Any]] = {}
    for sid in sorted(sessions):
        s = session_stats(sessions[sid])
        row = rows.setdefault(label(sessions[sid]), {"sessions": 0, "calls": 0, "main_calls": 0, "side_calls": 0,
                                                     "failed_calls": 0, "parse_errors": 0, "continuations": 0,
                                                     "merged": 0, "gateway_merged": 0, "unresolved": 0, "breaks": Counter()})
        row["sessions"] += 1
        for k, v in s.items():
            row[k] += v
    for row in rows.values():
        n = row["continuations"]
        row["merge_rate"] = round(row["merged"] / n, 4) if n else None
        row["gateway_agrees"] = row["gateway_merged"] == row["merged"]
        row["breaks"] = dict(sorted(row["breaks"].items()))
    return dict(sorted(rows.items()))


def read_calls(settings) -> list[CallRecorded]:
    """Every CallRecorded of the settings' calls topic, as it is now (a bounded read; never commits).

    A record that does not decode is skipped with a warning naming its offset (a report, not a gate).
    """
    import logging

    from producers.kafka_read import merged, plan_spans
    from schemas import RecordDecodeError, decode

    out = []
    for m in merged(settings, plan_spans(settings, ("calls",))):
        try:
            out.append(decode(m.value, CallRecorded))
        except RecordDecodeError as e:
            logging.getLogger(__name__).warning("skipping undecodable call at %s[%d]@%d: %s", m.topic, m.partition, m.offset, e)
    return out


def markdown_table(report: dict[str, dict[str, Any]]) -> str:
    """The report as a markdown table (one row per harness/provider)."""
    lines = ["| harness / API | sessions | calls (main + side + failed) | continuations | merged | merge rate | breaks |",
             "|---|---|---|---|---|---|---|"]
    for name, r in report.items():
        rate = "-" if r["merge_rate"] is None else f"{r['merge_rate']:.2f}"
        breaks = ", ".join(f"{k} {v}" for k, v in r["breaks"].items()) or "none"
        lines.append(f"| {name} | {r['sessions']} | {r['calls']} ({r['main_calls']} + {r['side_calls']} + "
                     f"{r['failed_calls']}) | {r['continuations']} | {r['merged']} | {rate} | {breaks} |")
    return "\n".join(lines)
