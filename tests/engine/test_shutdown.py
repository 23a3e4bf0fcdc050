"""A paused engine stops on SIGTERM within its grace period, even with requests held.

Before: pause it, send a request (held), SIGTERM: uvicorn waited for that request for ever ("waiting for
background tasks"); only SIGKILL ended the process. Now the server, told to stop, first ends what the engine
holds (engine/app.py ``make_server``): a frozen running request ends with ``finish_reason="abort"``, a queued
one is answered 503, and the process exits."""

import concurrent.futures
import signal
import time

import httpx

from engine.app import GRACE_S
from tests.plugins.engine import EngineProcess


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "tiny", **body}, timeout=60)

def test_a_paused_engine_with_held_requests_stops_on_sigterm(tiny_model_dir):
    engine = EngineProcess(tiny_model_dir).wait_ready()
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = pool.submit(post, engine.url, {"prompt": "long", "max_tokens": 4000, "ignore_eos": True,
                                                     "return_token_ids": True})
            deadline = time.monotonic() + 60
            while httpx.get(f"{engine.url}/stats", timeout=10).json()["decode_steps"] < 5:  # generating
                assert time.monotonic() < deadline and not running.done()
                time.sleep(0.01)
            assert httpx.post(f"{engine.url}/pause", params={"mode": "keep"}, timeout=30).json() == {"status": "paused"}
            queued = pool.submit(post, engine.url, {"prompt": "x", "max_tokens": 2})
            time.sleep(0.5)
            assert not running.done() and not queued.done()  # one frozen, one held in the queue
            t0 = time.monotonic()
            engine.proc.send_signal(signal.SIGTERM)
            engine.proc.wait(timeout=GRACE_S + 10)  # raises TimeoutExpired when it does not stop
            stopped_s = time.monotonic() - t0
            (choice,) = running.result(timeout=5).json()["choices"]
            held = queued.result(timeout=5)
        assert stopped_s < GRACE_S + 5, stopped_s
        assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 4000
        assert held.status_code == 503 and "shutting down" in held.json()["error"]["message"]
    finally:
        engine.stop()
