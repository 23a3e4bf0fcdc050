"""A judge endpoint that applies a rubric by rule: a real HTTP server speaking Chat Completions.

It stands in for an LLM judge where a test or the judge-only demo needs one that is right and cheap. It
reads the rubric's rule line out of the system message it is sent (``Rule: answer=<text>`` or ``Rule:
shortest``) and scores the transcript in the user message:

- ``answer=<text>``: +5 when the transcript's last write of a file's ``content`` is exactly <text>,
  -5 when it wrote something else, -3 when it wrote nothing (a tool call in the model's markup or JSON);
- ``arith``: the same with <text> the sum the task asks for ("Compute a + b", the demo's family), and -5
  when nothing was written: judge-only, (score + 5) / 10 is then the test command's 1 or 0;
- ``shortest``: 5 - (the transcript's length / 200), clipped to [-5, 5]: a second rubric whose scores
  differ from the first's, for re-judging.

Asked for process scores (the system message asks for ``"calls"``), it applies the rule to each call
under its ``### Call k`` heading as well.

With ``--fail-rate`` it fails that share of requests, chosen by a hash of the request and how often it was
asked (so a retry can succeed, and a run is reproducible): in turn a timeout (no answer for
``--stall-s``), a 429 with Retry-After, a 200 whose content is not a verdict, and a 500. Every request's
arrival time and outcome go to ``--log`` (JSON lines): the rate limits are checked against that log.

    python -m polarstream.tools.rule_judge --port 8300 --fail-rate 0.2 --log judge.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RULE = re.compile(r"^Rule:\s*(answer=(?P<answer>.*?)|(?P<shortest>shortest)|(?P<arith>arith))\s*$", re.M)
_SUM = re.compile(r"Compute (\d+) \+ (\d+)")  # the arith family's instruction (polarstream/demo/arith.py)
_CALL = re.compile(r"^### Call \d+\n", re.M)
_CONTENT = re.compile(r'"content"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ESCAPED_CONTENT = re.compile(r'\\"content\\"\s*:\s*\\"(.*?)\\"')  # inside arguments sent as a JSON string
FAILURES = ("timeout", "rate_limited", "garbage", "server_error")


def score(system: str, transcript: str) -> tuple[int, str]:
    """(score in [-5, 5], reason) of the transcript under the rule of the rubric in ``system``."""
    rule = _RULE.search(system)
    if rule is None:
        return 0, "no rule in the rubric"
    if rule.group("shortest"):
        return max(-5, min(5, 5 - len(transcript) // 200)), f"{len(transcript)} characters"
    if rule.group("arith"):
        task = _SUM.search(system) or _SUM.search(transcript)  # the task as the judge is told it, or as the agent was
        if task is None:
            return 0, "no sum in the task"
        expected, missing = str(int(task.group(1)) + int(task.group(2))), -5  # judge-only: the outcome's 0 and 1
    else:
        expected, missing = rule.group("answer").strip(), -3
    writes = [(m.start(), json.loads(f'"{m.group(1)}"')) for m in _CONTENT.finditer(transcript)]
    writes += [(m.start(), m.group(1)) for m in _ESCAPED_CONTENT.finditer(transcript)]
    if not writes:
        return missing, "no answer written"
    got = max(writes)[1].strip()  # the last write
    return (5, "correct answer") if got == expected else (-5, f"wrote {got[:40]!r}, expected {expected!r}")


def failure_for(key: str, asked: int, rate: float, seed: int) -> str:
    """'' or the failure this request gets: ``rate`` of (request, ask count) pairs fail, classes in turn."""
    h = int(hashlib.sha256(f"{seed}|{key}|{asked}".encode()).hexdigest()[:12], 16)
    if (h % 10_000) / 10_000 >= rate:
        return ""
    return FAILURES[(h // 10_000) % len(FAILURES)]


class RuleJudge(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, log: Path | None, fail_rate: float = 0.0, stall_s: float = 30.0, seed: int = 0):
        super().__init__(("127.0.0.1", port), _Handler)
        self.log_path, self.fail_rate, self.stall_s, self.seed = log, fail_rate, stall_s, seed
        self.asked: Counter = Counter()
        self.lock = threading.Lock()

    def handle_error(self, request, client_address) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):  # a caller that gave up on a stalled answer
            super().handle_error(request, client_address)

    def record(self, entry: dict) -> None:
        if self.log_path is None:
            return
        with self.lock, self.log_path.open("a") as f:
            f.write(json.dumps(entry) + "\n")


class _Handler(BaseHTTPRequestHandler):
    server: RuleJudge

    def log_message(self, *args) -> None:  # the JSON log is the record; no stderr line per request
        pass

    def _send(self, status: int, body: dict | str, headers: dict | None = None) -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        arrived = time.time()
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if not self.path.rstrip("/").endswith("/chat/completions"):
            return self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
        try:
            body = json.loads(raw)
            messages = body["messages"]
            system = "\n".join(m["content"] for m in messages if m["role"] == "system")
            user = "\n".join(m["content"] for m in messages if m["role"] == "user")
        except (ValueError, KeyError, TypeError):
            return self._send(400, {"error": {"message": "expected a chat completion request", "type": "invalid_request_error"}})
        key = hashlib.sha256(raw).hexdigest()[:16]
        with self.server.lock:
            self.server.asked[key] += 1
            asked = self.server.asked[key]
        failure = failure_for(key, asked, self.server.fail_rate, self.server.seed)
        self.server.record({"t": arrived, "key": key, "asked": asked, "outcome": failure or "ok",
                            "rule": (_RULE.search(system) or [""])[0]})
        if failure == "timeout":
            time.sleep(self.server.stall_s)
            return self._send(504, {"error": {"message": "stalled", "type": "timeout"}})
        if failure == "rate_limited":
            return self._send(429, {"error": {"message": "slow down", "type": "rate_limit"}}, {"Retry-After": "0.2"})
        if failure == "server_error":
            return self._send(500, {"error": {"message": "injected failure", "type": "server_error"}})
        s, reason = score(system, user)
        verdict = {"score": s, "reason": reason}
        if '"calls"' in system:  # process scores asked for: the rule applied to each call on its own
            verdict["calls"] = [score(system, call)[0] for call in _CALL.split(user)[1:]]
        content = "The score is probably fine." if failure == "garbage" else json.dumps(verdict)
        self._send(200, {
            "id": f"chatcmpl-{key}", "object": "chat.completion", "created": int(arrived), "model": body.get("model", "rule"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(system + user) // 4, "completion_tokens": len(content) // 4},
        })


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--log", type=Path, default=None, help="JSON lines: each request's arrival time and outcome")
    p.add_argument("--fail-rate", type=float, default=0.0)
    p.add_argument("--stall-s", type=float, default=30.0, help="how long an injected timeout keeps the caller waiting")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    server = RuleJudge(a.port, a.log, a.fail_rate, a.stall_s, a.seed)
    print(f"rule judge on http://127.0.0.1:{server.server_address[1]}/v1", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
