"""Fuzz the four provider APIs of a live gateway: Kafka, the scripted tiny engine, ``polarstream gateway``.

Each server runs in its own process, so a gateway crash shows as a dead process. Per API, hypothesis
draws ``--per-api`` requests (tests/fuzz/strategies.py: valid conversations, mutated bodies, raw bytes,
oversized and deeply nested ones); they are sent ``--concurrency`` at a time over a few sessions and each
answer is judged (tests/fuzz/client.py). Then a few hostile connections per API: a client that
disconnects mid-body, one that stalls past the body timeout, one that leaves before its answer. Last,
the calls topic is read back: every answered call must be there.

Prints one JSON object: requests tried per API, error classes returned, problems (5xx other than the
documented 502/503/504, wrong shapes, hangs, dropped connections), crashes (gateway process deaths),
and answered vs recorded.

    .venv/bin/python bench/fuzz.py [--quick] [--per-api N] [--seed S] [--out FILE] [--bootstrap HOST:PORT]
"""

from __future__ import annotations

MEASURES = ('gateway/', 'producers/', 'schemas/')  # the code these figures describe (bench/_provenance.py)

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._procs import kafka_for_bench, server_env, spawn, stop, wait_http  # after the path insert: run as a script

SCRIPT = """\
turns:
  - match: "(?i)title"
    text: '{"title": "Fuzzed"}'
  - tool_calls:
      - name: write_file
        arguments: {path: hello.txt, content: hi}
  - text: Done.
fallback:
  text: Nothing more to do.
"""
BODY_TIMEOUT_S = 5.0
CHUNK = 500  # cases drawn per hypothesis run (a fresh seed each)
SCRIPT_WINDOW = ["--script-window", "512"]  # scripted turns scored on the prompt's tail only (speed)
UPSTREAM_TIMEOUT_S = 60.0


def draw_chunk(provider: str, size: int, seed: int) -> list:
    """``size`` cases for ``provider`` (run in the worker process)."""
    from tests.fuzz.strategies import collect_mix

    return collect_mix(provider, size, seed_value=seed)


def hostile(port: int, path: str, headers: dict[str, str], body: bytes, mode: str) -> str:
    """One raw-socket client: ``cut`` (disconnect mid-body), ``stall`` (body never finishes), ``leave``
    (full request, gone before the answer). Returns the status line it got, or '' when it left."""
    s = socket.create_connection(("127.0.0.1", port), timeout=BODY_TIMEOUT_S + 30)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    s.sendall(f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: {len(body)}\r\n{head}\r\n".encode())
    try:
        if mode == "cut":
            s.sendall(body[: len(body) // 2])
            return ""
        if mode == "leave":
            s.sendall(body)
            return ""
        s.sendall(body[:10])  # stall: the gateway must answer 408 once the body timeout passes
        return s.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace")
    finally:
        s.close()


def read_recorded(settings, expected: set[str], timeout: float = 120.0) -> dict[str, tuple[str, str]]:
    """event_id -> (session id, error: '' for answered calls) of every CallRecorded on the calls topic."""
    from producers.consumer import RecordConsumer

    consumer = RecordConsumer(settings, topics=["calls"], from_beginning=True)
    seen: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    quiet_until = 0.0
    try:
        while time.monotonic() < deadline:
            items = consumer.poll(0.5)
            for item in items:
                seen[item.record.event_id] = (item.record.session_id, item.record.error)
            if expected <= seen.keys():
                quiet_until = quiet_until or time.monotonic() + 3  # a little longer: extra records show up too
                if time.monotonic() > quiet_until:
                    break
    finally:
        consumer.close()
    return seen


async def run(args: argparse.Namespace) -> dict:
    from schemas.session_keys import mint_session_key
    from infra.models import ensure_model
    from infra.process import free_port
    from tests.fuzz.client import auth_headers, send_all, summarize
    from tests.fuzz.strategies import PROVIDERS, RENDER, conversations

    tmp = Path(tempfile.mkdtemp(prefix="bench-fuzz-"))
    procs: list[subprocess.Popen] = []
    kafka = None
    n = args.per_api or (200 if args.quick else 10_000)
    result: dict = {"mode": "quick" if args.quick else "full", "per_api": n, "seed": args.seed, "cores": os.cpu_count(),
                    "load_avg_start": round(os.getloadavg()[0], 2)}
    t_start = time.monotonic()
    try:
        model_dir = ensure_model("tiny")
        settings, kafka = kafka_for_bench(args.bootstrap, tmp, "fuzz")
        cli = [sys.executable, "-c", "from polarstream.cli import main; main()"]
        env = server_env(settings, tmp)
        (tmp / "script.yaml").write_text(SCRIPT)
        eport, gport = free_port(), free_port()
        engine_help = subprocess.run([*cli, "engine", "--help"], capture_output=True, text=True, env={**os.environ, **env}).stdout
        window = SCRIPT_WINDOW if "--script-window" in engine_help else []
        procs.append(spawn([*cli, "engine", "--model", "tiny", "--script", str(tmp / "script.yaml"), "--port", str(eport),
                            "--max-model-len", "4096", *window], tmp / "engine.log", env))
        wait_http(f"http://127.0.0.1:{eport}/health", procs[-1], timeout=180)
        procs.append(spawn([*cli, "gateway", "--engine-url", f"http://127.0.0.1:{eport}", "--model", str(model_dir),
                            "--port", str(gport), "--max-body-mb", "1", "--upstream-timeout", str(UPSTREAM_TIMEOUT_S),
                            "--max-messages", "1000", "--max-tools", "256", "--body-timeout", str(BODY_TIMEOUT_S),
                            "--log-level", "warning"], tmp / "gateway.log", env))
        gateway = procs[-1]
        base = f"http://127.0.0.1:{gport}"
        wait_http(base + "/health", gateway)
        keys = [mint_session_key(f"fuzz-{i}", settings.session_secret) for i in range(args.sessions)]

        # Hypothesis draws chunks in a worker process while the previous chunk is being sent.
        chunks = [(p, min(CHUNK, n - i), args.seed * 100_000 + i) for p in PROVIDERS for i in range(0, n, CHUNK)]
        outcomes, send_s = [], 0.0
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(1, mp_context=ctx) as pool:
            futures = [pool.submit(draw_chunk, *c) for c in chunks]
            for (provider, size, _), fut in zip(chunks, futures):
                cases = await asyncio.wrap_future(fut)
                t1 = time.monotonic()
                outcomes += await send_all(base, keys, cases, concurrency=args.concurrency, timeout=UPSTREAM_TIMEOUT_S + 30)
                send_s += time.monotonic() - t1
                done = sum(1 for o in outcomes if o.provider == provider)
                print(f"{provider}: {done}/{n} sent ({time.monotonic() - t_start:.0f}s)", file=sys.stderr, flush=True)

        # Hostile connections, on a session of their own (a 'leave' call may be recorded yet unanswered).
        from hypothesis import find

        conv = find(conversations(), lambda c: not c.stream)
        hostile_key = mint_session_key("fuzz-hostile", settings.session_secret)
        statuses: dict[str, list[str]] = {"cut": [], "stall": [], "leave": []}
        for provider in PROVIDERS:
            path, body = RENDER[provider](conv)
            raw = json.dumps(body).encode()
            headers = {**auth_headers(provider, hostile_key), "content-type": "application/json"}
            for mode in statuses:
                statuses[mode].append(await asyncio.to_thread(hostile, gport, path, headers, raw, mode))
        healthy = (await asyncio.to_thread(__import__("httpx").get, base + "/health", timeout=10)).status_code == 200

        answered = {o.event_id for o in outcomes if o.event_id}
        recorded = read_recorded(settings, answered)
        succeeded = {e for e, (_, err) in recorded.items() if not err}
        unread = {e for e in succeeded - answered if recorded[e][0] != "fuzz-hostile"}  # 'leave' clients may leave some
        result.update(
            apis=summarize(outcomes, set(recorded)),
            requests=len(outcomes),
            problems=[{"provider": o.provider, "family": o.family, "class": o.error_class, "problem": o.problem[:300]}
                      for o in outcomes if o.problem][:20],
            problem_count=sum(1 for o in outcomes if o.problem),
            hangs=sum(1 for o in outcomes if o.error_class == "hang"),
            hostile={"stall_answers": statuses["stall"], "cut": len(statuses["cut"]), "leave": len(statuses["leave"]),
                     "healthy_after": healthy},
            crashes=0 if gateway.poll() is None else 1,
            gateway_log_tracebacks=(tmp / "gateway.log").read_text(errors="replace").count("Traceback"),
            answered=len(answered),
            recorded_answered=len(answered & succeeded),
            recorded_failed_calls=sum(1 for _, err in recorded.values() if err),
            answered_equals_recorded=answered <= succeeded and not unread,
            send_s=round(send_s, 1),
        )
    finally:
        stop(procs, timeout=30)
        if kafka is not None:
            kafka.stop()
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    result["load_avg_end"] = round(os.getloadavg()[0], 2)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="200 requests per API (under a minute or two)")
    ap.add_argument("--per-api", type=int, default=0, help="requests per API (default 10,000; --quick 200)")
    ap.add_argument("--seed", type=int, default=12, help="hypothesis seed (the run is reproducible)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=16, help="session keys the requests are spread over")
    ap.add_argument("--bootstrap", default="", help="use this running Kafka instead of starting one")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup: the servers are in their own sessions
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    sys.exit(0 if result["crashes"] == 0 and result["problem_count"] == 0 and result["answered_equals_recorded"] else 1)


if __name__ == "__main__":
    main()
