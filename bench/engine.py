"""Engine generation speed: generated tokens/s at batch 1, 8 and 32 for the tiny model, over HTTP.

Starts a real engine (uvicorn in a background thread, on a free port) serving the tiny model, sends
``batch`` concurrent /v1/completions requests (different prompts, ``ignore_eos`` so every request
generates exactly ``tokens`` tokens, return_token_ids and logprobs on, as the gateway asks) and prints
one JSON object: per batch size the generated tokens/s (median of the rounds), the wall time and how
many decode steps the engine ran (batching at work: steps stay ~``tokens`` whatever the batch).

    .venv/bin/python bench/engine.py [--quick] [--threads N] [--model tiny]
"""

from __future__ import annotations

MEASURES = ('engine/',)  # the code these figures describe (bench/_provenance.py)

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from engine.local import start_engine_server  # noqa: E402
from infra.models import resolve_model  # noqa: E402


async def one_round(url: str, batch: int, tokens: int, round_no: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def call(i: int) -> int:
            r = await client.post("/v1/completions", json={
                "prompt": f"Request {i} of round {round_no}: write a function that adds two numbers.",
                "max_tokens": tokens, "ignore_eos": True, "temperature": 1.0, "seed": i,
                "logprobs": 0, "return_token_ids": True})
            r.raise_for_status()
            return len(r.json()["choices"][0]["token_ids"])

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(call(i) for i in range(batch)))
        elapsed = time.perf_counter() - t0
    assert sum(counts) == batch * tokens
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="32 tokens, one round per batch size (< 1 minute)")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--threads", type=int, default=0, help="engine CPU threads (0: the engine's default)")
    args = ap.parse_args()
    tokens, rounds = (32, 1) if args.quick else (128, 3)

    server = start_engine_server(resolve_model(args.model), name=args.model, threads=args.threads)
    results = {}
    try:
        asyncio.run(one_round(server.url, 2, 4, -1))  # warm-up: first-call allocations, tokenizer caches
        for batch in (1, 8, 32):
            stats = server.engine.batcher.stats
            steps0 = stats["decode_steps"]
            times = [asyncio.run(one_round(server.url, batch, tokens, r)) for r in range(rounds)]
            med = statistics.median(times)
            results[f"batch_{batch}"] = {
                "generated_tokens_per_s": round(batch * tokens / med, 1),
                "wall_s": round(med, 3),
                "decode_steps_per_round": (stats["decode_steps"] - steps0) // rounds,
            }
    finally:
        server.stop()
    print(json.dumps({
        "bench": "engine", "model": args.model, "tokens_per_request": tokens, "rounds": rounds,
        "engine_threads": server.engine.batcher.threads, "cpu_count": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2), "machine": platform.machine(), "quick": args.quick,
        **results,
    }, indent=2))


if __name__ == "__main__":
    main()
