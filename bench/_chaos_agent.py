"""The agent of bench/chaos.py's workload: a deterministic multi-turn session that keeps a ledger.

Run by a gateway node as a ``command`` harness (standard library only). Its session id ``<task>.s<i>``
(``.a<k>`` on a re-run) decides everything, so a re-run, or the uninterrupted reference run, sends
exactly the same prompts: ``2 + i % 3`` calls, each extending the last, then ``answer.txt`` holds 7 for
even samples and 8 for odd ones (the evaluator wants 7, so every group has rewards of both kinds).

After each answer it appends ``{"session", "turn", "id"}`` to the ledger file named by CHAOS_LEDGER
(O_APPEND, one write per line): ``id`` is the response id, ``chatcmpl-<event_id>``, and the gateway
sends an answer only after the broker acknowledged its record, so every ledger id must be on
polar.calls exactly once. A call that fails for good is logged with ``failed`` and the agent exits 3.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.error
import urllib.request


def log(path: str, entry: dict) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())
    finally:
        os.close(fd)


def post(url: str, key: str, body: dict) -> dict:
    """POST, retrying what a restarting component causes (connection refused, 429, 502-504) for ~30 s."""
    data = json.dumps(body).encode()
    error = ""
    for attempt in range(12):
        req = urllib.request.Request(url, data=data, method="POST",
                                     headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            error = f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}"
            if e.code not in (429, 502, 503, 504):
                break
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            error = f"{type(e).__name__}: {e}"
        time.sleep(min(0.5 * (attempt + 1), 4.0))
    raise RuntimeError(error)


def main() -> int:
    session = os.environ["POLAR_SESSION_ID"]
    ledger = os.environ["CHAOS_LEDGER"]
    sample = int(re.search(r"\.s(\d+)", session).group(1))
    calls = 2 + sample % 3
    messages = [{"role": "system", "content": "You are a careful agent. Work through the steps you are given."},
                {"role": "user", "content": os.environ["POLAR_INSTRUCTION"] + f" Begin with step 1 of {calls}."}]
    url = os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions"
    key = os.environ["OPENAI_API_KEY"]
    for turn in range(calls):
        try:
            resp = post(url, key, {"model": os.environ.get("POLAR_MODEL", "polar"), "messages": messages, "max_tokens": 24})
        except RuntimeError as e:
            log(ledger, {"session": session, "turn": turn, "failed": str(e)})
            return 3
        log(ledger, {"session": session, "turn": turn, "id": resp["id"]})
        messages += [{"role": "assistant", "content": resp["choices"][0]["message"].get("content") or ""},
                     {"role": "user", "content": f"Continue with step {turn + 2} of {calls}."}]
    with open("answer.txt", "w") as f:
        f.write("7" if sample % 2 == 0 else "8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
