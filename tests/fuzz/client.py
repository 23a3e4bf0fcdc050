"""Send fuzz cases to a live gateway and judge each answer; shared by tests/fuzz and bench/fuzz.py.

An answer is fine when it is a 2xx in the provider's success shape (JSON, or SSE for a streaming
request) carrying the call's id, or an error in the provider's own error shape with a 4xx status or a
documented 5xx (502/503/504: engine or event-log trouble, each with its own message). Anything else is
a *problem*: another 5xx, a body in the wrong shape, a connection the gateway dropped, or no answer
within the timeout (a hang). ``event_id`` of a success is what must appear on polar.calls.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from .strategies import Case

DOCUMENTED_5XX = {502, 503, 504}  # engine transport / Kafka unavailable / engine timeout (docs/gateway.md)
ID_PREFIX = {"anthropic.messages": "msg_", "openai.chat": "chatcmpl-", "openai.responses": "resp_", "google.generate_content": ""}


@dataclass
class Outcome:
    provider: str
    family: str
    status: int  # 0: no HTTP answer
    error_class: str  # "200", "400 invalid_request_error", "hang", "disconnect"...
    event_id: str = ""  # the recorded call's id, for answered calls
    problem: str = ""  # why this answer is not acceptable ('' when it is)
    seconds: float = 0.0


def auth_headers(provider: str, key: str) -> dict[str, str]:
    """The key where the provider's SDK puts it."""
    if provider == "anthropic.messages":
        return {"x-api-key": key, "anthropic-version": "2023-06-01"}
    if provider == "google.generate_content":
        return {"x-goog-api-key": key}
    return {"authorization": f"Bearer {key}"}


def error_kind(provider: str, body: Any) -> str | None:
    """The error type when ``body`` is an error in ``provider``'s shape, else None."""
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    if provider == "anthropic.messages":
        ok = body.get("type") == "error" and isinstance(err, dict) and isinstance(err.get("message"), str)
        return err.get("type") if ok else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return None
    if provider == "google.generate_content":
        return err.get("status") if isinstance(err.get("code"), int) else None
    return err.get("code") or err.get("type")


def sse_events(raw: bytes) -> list[Any]:
    """Decoded ``data:`` payloads of an SSE body (``[DONE]`` dropped); ValueError on a malformed frame."""
    out = []
    for frame in raw.decode().split("\n\n"):
        data = [ln[6:] for ln in frame.split("\n") if ln.startswith("data: ")]
        if data and data[0] != "[DONE]":
            out.append(json.loads("\n".join(data)))
    return out


def success_id(provider: str, raw: bytes, stream: bool) -> str:
    """The call id in a success body (the recorded event's id), or '' when the body is not the provider's shape."""
    # A call still running after the gateway's keep-alive delay (a loaded machine) opens with Anthropic's
    # ping events before message_start, as the API may; the SDKs drop them, and so does this judge.
    first = [e for e in sse_events(raw) if not (isinstance(e, dict) and e.get("type") == "ping")][0] if stream else json.loads(raw)
    if isinstance(first, list) and provider == "google.generate_content":  # streamGenerateContent without alt=sse
        first = first[0]
    if provider == "anthropic.messages":
        msg = first.get("message", {}) if stream else first
        rid = msg.get("id", "") if msg.get("type") == "message" else ""
    elif provider == "openai.responses":
        resp = first.get("response", {}) if stream else first
        rid = resp.get("id", "") if resp.get("object") == "response" else ""
    elif provider == "openai.chat":
        rid = first.get("id", "") if first.get("choices") is not None else ""
    else:
        rid = first.get("responseId", "") if first.get("candidates") else ""
    prefix = ID_PREFIX[provider]
    return rid[len(prefix):] if rid.startswith(prefix) else ""


def judge(case: Case, status: int, ctype: str, raw: bytes) -> tuple[str, str, str]:
    """(error class, event id, problem) for one HTTP answer."""
    if 200 <= status < 300:
        want_sse = case.stream
        if want_sse != ctype.startswith("text/event-stream"):
            return str(status), "", f"content-type {ctype!r} for stream={want_sse}"
        try:
            rid = success_id(case.provider, raw, want_sse)
        except (ValueError, IndexError, AttributeError, TypeError) as e:
            return str(status), "", f"success body not in the provider's shape ({type(e).__name__}: {e})"
        return str(status), rid, "" if rid else "success body without the call's id"
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    kind = error_kind(case.provider, body)
    if kind is None:
        return f"{status} ?", "", f"error body not in the provider's shape: {raw[:200]!r}"
    problem = f"5xx: {raw[:300]!r}" if status >= 500 and status not in DOCUMENTED_5XX else ""
    return f"{status} {kind}", "", problem


async def send(client: httpx.AsyncClient, base: str, key: str, case: Case, timeout: float) -> Outcome:
    """POST one case and judge the answer."""
    t0 = time.perf_counter()
    headers = {**auth_headers(case.provider, key), **case.headers}
    try:
        r = await client.post(base + case.path, content=case.body, headers=headers, timeout=timeout)
    except httpx.TimeoutException:
        return Outcome(case.provider, case.family, 0, "hang", problem=f"no answer within {timeout:g}s", seconds=time.perf_counter() - t0)
    except httpx.TransportError as e:
        return Outcome(case.provider, case.family, 0, "disconnect", problem=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
    cls, rid, problem = judge(case, r.status_code, r.headers.get("content-type", ""), r.content)
    return Outcome(case.provider, case.family, r.status_code, cls, rid, problem, time.perf_counter() - t0)


async def send_all(base: str, keys: Sequence[str], cases: Iterable[Case], *, concurrency: int = 8,
                   timeout: float = 60.0) -> list[Outcome]:
    """Send every case (case i under ``keys[i % len(keys)]``), ``concurrency`` at a time."""
    cases = list(cases)
    out: list[Outcome | None] = [None] * len(cases)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(cases)):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                out[i] = await send(client, base, keys[i % len(keys)], cases[i], timeout)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [o for o in out if o is not None]


def summarize(outcomes: Sequence[Outcome], recorded_ids: set[str] | None = None) -> dict[str, Any]:
    """Per provider: requests, answers by error class and family, problems; answered vs recorded."""
    report: dict[str, Any] = {}
    for provider in sorted({o.provider for o in outcomes}):
        mine = [o for o in outcomes if o.provider == provider]
        answered = {o.event_id for o in mine if o.event_id}
        entry: dict[str, Any] = {
            "requests": len(mine),
            "error_classes": dict(Counter(o.error_class for o in mine).most_common()),
            "families": dict(Counter(o.family.split(".")[0] for o in mine).most_common()),
            "answered": len(answered),
            "problems": len([o for o in mine if o.problem]),
            "max_seconds": round(max((o.seconds for o in mine), default=0.0), 3),
            "slowest_family": max(mine, key=lambda o: o.seconds).family if mine else "",
        }
        if recorded_ids is not None:
            entry["answered_not_recorded"] = len(answered - recorded_ids)
        report[provider] = entry
    return report
