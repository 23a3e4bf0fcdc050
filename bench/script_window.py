"""Scripted-mode latency with and without ``script_window``, for harness-sized prompts.

Starts two real engines serving the tiny model with the same script (one tool-call turn), one with a
full prefill (``script_window`` 0) and one scoring the turn over the prompt's last 256 tokens, and sends
each a chat request whose user message makes the prompt about ``tokens`` tokens long (40-80 KB harness
prompts are 10-25 k tokens with the tiny tokenizer). Prints one JSON object: per prompt size the median
seconds per request of each engine and the speed-up. Requests go one at a time with distinct prompts,
so the prefix cache never helps. Per prompt size the two engines run in interleaved rounds
(bench/_rounds.py: window 0, window 256, window 0, ...), so a load change hits both alike; the seconds per
call are medians over rounds and ``rounds`` keeps min, spread and CPU/wall (engines run in this process).

    .venv/bin/python bench/script_window.py [--quick]
"""

from __future__ import annotations

MEASURES = ('engine/',)  # the code these figures describe (bench/_provenance.py)

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench._rounds import interleaved  # noqa: E402
from engine.local import start_engine_server  # noqa: E402
from infra.models import ensure_model  # noqa: E402

SCRIPT = "turns:\n  - tool_calls: [{name: bash, arguments: {command: 'echo 7 > answer.txt'}}]\n"
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a command",
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]


def one(url: str, words: int, salt: int) -> tuple[float, int]:
    """Seconds for one scripted chat call with a prompt of about ``words`` words; its prompt length in tokens."""
    text = f"Task {salt}. " + " ".join(f"w{(salt * 7919 + i) % 5000}" for i in range(words))
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": text}],
                                                       "tools": TOOLS, "logprobs": True, "return_token_ids": True}, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0, len(r.json()["prompt_token_ids"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="prompts of ~500 and ~1.5k words, 3 rounds (< 1 minute)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of both engines (fixed: comparable passes)")
    args = ap.parse_args()
    # Full prefill grows faster than linearly: these sizes keep 3 rounds inside the budget in bench/run_all.py.
    sizes, rounds = ((500, 1500), 3) if args.quick else ((1000, 3000, 5000), 3)
    model = ensure_model("tiny")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "script.yaml"
        script.write_text(SCRIPT)
        engines = {w: start_engine_server(model, script=script, script_window=w, threads=args.threads) for w in (0, 256)}
        try:
            one(engines[0].url, 10, -1), one(engines[256].url, 10, -1)  # warm-up
            results, all_rounds = [], {}
            for words in sizes:
                salt = iter(range(10**6))  # distinct prompts: the prefix cache never helps

                def call(w: int, words: int = words) -> dict:
                    _, n = one(engines[w].url, words, words * 10 + next(salt) + (100_000 if w else 0))
                    return {"prompt_tokens": n}

                res = interleaved({f"window_{w}": (lambda w=w: call(w)) for w in engines}, rounds, threads=args.threads,
                                  cpu_floor=0.5, retries=1, progress=False)  # one thread: under half a core is starved
                row: dict = {"words": words, "prompt_tokens": res["targets"]["window_0"]["metrics"]["prompt_tokens"]}
                for w in engines:
                    row[f"s_per_call_window_{w}"] = round(res["targets"][f"window_{w}"]["wall_s"]["median"], 3)
                row["speedup"] = round(row["s_per_call_window_0"] / row["s_per_call_window_256"], 1)
                results.append(row)
                all_rounds[f"words_{words}"] = res
        finally:
            for s in engines.values():
                s.stop()
    print(json.dumps({"bench": "script_window", "quick": args.quick, "results": results, "rounds": all_rounds,
                      "machine": {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 1),
                                  "python": platform.python_version()}}, indent=2))


if __name__ == "__main__":
    main()
