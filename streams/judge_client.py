"""Asking a judge endpoint (OpenAI Chat Completions) under limits, with retries, and classing failures.

Limits are per worker: at most ``concurrency`` requests in flight, and in any ``window_s`` (60 s: per
minute) at most ``requests_per_window`` requests and ``tokens_per_window`` tokens asked for (the prompt's
tokens plus the verdict's budget), as the server would count them: a sliding window (WindowLimiter), so
the limit holds over every window, where a refilling token bucket lets a burst of its capacity through
on top of its rate. A retried request counts again: the server sees it again.

Failures: a timeout, a 429 (``rate_limited``), another HTTP error or a connection error
(``http_error``), a refusal, a reply that is not a verdict (``unparseable``). All but a refusal are
retried with exponential backoff (a 429's Retry-After if longer); the last attempt's class is the
verdict's failure.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

import httpx

from schemas import JudgeVerdict, Trajectory

from .judge import JudgeConfig, VerdictError, chunk_score, parse_verdict, system_prompt, transcript_chunks, verdict_id


class WindowLimiter:
    """At most ``requests`` requests and ``tokens`` tokens in any sliding ``window_s``, as the server sees them.

    A request holds its place from its start until ``window_s`` after it ended (its answer, error or
    timeout), not after it started: the server logs its arrival somewhere in between, and a request
    started one window after an earlier one could otherwise arrive within the same window as that one
    if the earlier one was slow to arrive (a new connection). Counting the earlier one until its end
    makes any window of arrivals hold at most the limit: of the requests arriving in it, each but the
    last started was still held when the last one started."""

    def __init__(self, requests: int, tokens: int, window_s: float, clock: Callable[[], float] = time.monotonic,
                 poll_s: float = 0.01):
        self.requests, self.tokens, self.window_s, self.clock, self.poll_s = requests, tokens, window_s, clock, poll_s
        self.held: list[list] = []  # [start, end or None while in flight, tokens]
        self.lock = asyncio.Lock()

    def wait_for(self, tokens: int) -> float:
        """Seconds until a request of ``tokens`` may start (0: now; ``poll_s`` when only an answer frees room)."""
        now = self.clock()
        self.held = [h for h in self.held if h[1] is None or h[1] > now - self.window_s]
        over_requests = len(self.held) - self.requests + 1
        over_tokens = sum(h[2] for h in self.held) + tokens - self.tokens if self.held else 0
        if over_requests <= 0 and over_tokens <= 0:
            return 0.0
        ended = sorted(h for h in self.held if h[1] is not None)  # by start; frees at end + window
        frees = sorted((h[1] + self.window_s, h[2]) for h in ended)
        waits = []
        if over_requests > 0:
            waits.append(frees[over_requests - 1][0] - now if len(frees) >= over_requests else self.poll_s)
        if over_tokens > 0:
            freed = 0
            for at, n in frees:
                freed += n
                if freed >= over_tokens:
                    waits.append(at - now)
                    break
            else:
                waits.append(self.poll_s)
        return max(max(waits), 0.0) or self.poll_s

    async def acquire(self, tokens: int) -> list:
        """Wait for room, then hold it; pass what this returns to ``release`` once the request ended."""
        async with self.lock:  # granted in order, each waiting for its own room
            while (delay := self.wait_for(tokens)) > 0:
                await asyncio.sleep(delay)
            held = [self.clock(), None, tokens]
            self.held.append(held)
            return held

    def release(self, held: list) -> None:
        held[1] = self.clock()


class JudgeClient:
    """One worker's connection to a judge: its limits are shared by every group the worker judges."""

    def __init__(self, config: JudgeConfig, decode: Callable[[list[int]], str], count_tokens: Callable[[str], int]):
        self.config, self.decode, self.count_tokens = config, decode, count_tokens
        self.fingerprint = config.fingerprint()
        self.limiter = WindowLimiter(config.requests_per_window, config.tokens_per_window, config.window_s)
        self.slots = asyncio.Semaphore(config.concurrency)
        headers = {"Authorization": f"Bearer {config.api_key.get_secret_value()}"} if config.api_key.get_secret_value() else {}
        self.http = httpx.AsyncClient(base_url=config.base_url.rstrip("/") + "/", headers=headers,
                                      timeout=httpx.Timeout(config.timeout_s))

    async def close(self) -> None:
        await self.http.aclose()

    async def judge(self, traj: Trajectory, rubric: str, instruction: str = "") -> JudgeVerdict:
        """The verdict on one trajectory (every chunk judged; the first failing chunk fails it)."""
        system = system_prompt(self.config, rubric, instruction)
        process = self.config.process
        chunks = transcript_chunks(traj, self.decode, self.config.chunk_tokens, headed=process)
        scores, reasons, call_scores, attempts, usage = [], [], [], 0, [0, 0]
        fields = dict(event_id=verdict_id(traj.event_id, self.fingerprint), group_id=traj.group_id,
                      session_id=traj.session_id, sample_index=traj.sample_index, trajectory_id=traj.event_id,
                      judge=self.fingerprint, model=self.config.model)
        for k, (text, calls) in enumerate(chunks):
            head = f"Transcript part {k + 1} of {len(chunks)}:\n\n" if len(chunks) > 1 else "Transcript:\n\n"
            messages = [{"role": "system", "content": system}, {"role": "user", "content": head + text}]
            outcome, tries, used = await self._ask(messages, calls if process else None)
            attempts += tries
            usage = [usage[0] + used[0], usage[1] + used[1]]
            if isinstance(outcome, VerdictError):
                return JudgeVerdict(**fields, failure=outcome.failure, detail=str(outcome)[:300], attempts=attempts,
                                    prompt_tokens=usage[0], completion_tokens=usage[1])
            scores.append(outcome[0])
            reasons.append(outcome[1])
            call_scores += outcome[2]
        return JudgeVerdict(**fields, score=chunk_score(scores), chunk_scores=scores, call_scores=call_scores,
                            detail=" | ".join(reasons)[:300], attempts=attempts, prompt_tokens=usage[0],
                            completion_tokens=usage[1])

    async def _ask(self, messages: list[dict], calls: int | None) -> tuple[tuple[float, str, list[float]] | VerdictError,
                                                                         int, tuple[int, int]]:
        """(verdict or the last failure, attempts made, (prompt, completion) tokens the server reported)."""
        body = {"model": self.config.model, "messages": messages, "max_tokens": self.config.max_tokens,
                "temperature": self.config.temperature}
        tokens = sum(self.count_tokens(m["content"]) for m in messages) + self.config.max_tokens
        failure: VerdictError = VerdictError("http_error", "not asked")
        for attempt in range(1, self.config.max_attempts + 1):
            retry_after = 0.0
            async with self.slots:
                held = await self.limiter.acquire(tokens)
                try:
                    resp = await self.http.post("chat/completions", json=body)
                except httpx.TimeoutException:
                    failure = VerdictError("timeout", f"no answer within {self.config.timeout_s:g} s")
                except httpx.HTTPError as e:
                    failure = VerdictError("http_error", f"{type(e).__name__}: {e}"[:300])
                else:
                    if resp.status_code == 429:
                        failure = VerdictError("rate_limited", f"429: {resp.text[:200]}")
                        retry_after = _seconds(resp.headers.get("retry-after"))
                    elif resp.status_code >= 400:
                        failure = VerdictError("http_error", f"{resp.status_code}: {resp.text[:200]}")
                    else:
                        try:
                            reply = resp.json()
                        except ValueError:
                            failure = VerdictError("unparseable", f"not JSON: {resp.text[:200]}")
                        else:
                            usage = (reply.get("usage") or {}) if isinstance(reply, dict) else {}
                            used = (int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)))
                            try:
                                return parse_verdict(reply, calls), attempt, used
                            except VerdictError as e:
                                failure = e
                finally:
                    self.limiter.release(held)
            if failure.failure == "refusal":  # asking again asks for the same refusal
                return failure, attempt, (0, 0)
            if attempt < self.config.max_attempts:
                await asyncio.sleep(max(self.config.backoff_s * 2 ** (attempt - 1), retry_after))
        return failure, self.config.max_attempts, (0, 0)


def _seconds(value: str | None) -> float:
    try:
        return max(0.0, float(value)) if value else 0.0
    except ValueError:
        return 0.0
