"""vLLM 0.33's RL route handlers and ours answer the same requests alike: status, and the body (for an error:
its type, code and param; vLLM's validation messages are pydantic's dump, so their wording is not compared).

vLLM's side (tests/engine/vllm_routes.py, in the vLLM peer venv) is its own router and exception handlers in a
FastAPI app whose engine client is a one-worker stand-in given our engine's digests: a real engine client needs a
GPU, and the route logic under test (modes, compare over both sides' names, 400s, world size) lives above it.

Not compared here, and why: an update_info on an engine with no group (vLLM's worker raises, a 500; ours a 409
naming the missing call); an empty update_info in a group is taken by both (test_vllm_oracle.py drives ours with
vLLM's own trainer)."""

import json
import os
import subprocess
from pathlib import Path

import httpx

HERE = Path(__file__).parent


def vllm_answers(vllm_python, checksums, requests):
    proc = subprocess.run([str(vllm_python), str(HERE / "vllm_routes.py")], input=json.dumps(
        {"checksums": checksums, "requests": requests}), capture_output=True, text=True, timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def comparable(status, body):
    if status >= 400:  # vLLM's ErrorResponse: compare all but the wording of validation messages
        err = body["error"]
        return status, {"type": err["type"], "code": err["code"], "param": err["param"]}
    return status, body


def test_vllm_route_handlers_and_ours_answer_alike(vllm_python, engine_server):
    url = engine_server.url
    ours = httpx.post(f"{url}/weight_checker", json={"action": "checksum"}, timeout=60).json()["checksums"]
    name = sorted(ours)[0]
    one_sided = {**{k: v for k, v in ours.items() if k != name}, "dp0:pp0:pcp0:tp0:not.in.the.model": "0" * 64}
    changed = {**ours, name: "f" * 64}
    requests = [
        ["GET", "/is_paused", None, None],
        ["POST", "/pause", {"mode": "wait"}, None],
        ["GET", "/is_paused", None, None],
        ["POST", "/resume", None, None],
        ["POST", "/pause", None, None],  # abort, vLLM's default
        ["POST", "/resume", None, None],
        ["POST", "/pause", {"mode": "keep"}, None],
        ["POST", "/resume", None, None],
        ["POST", "/pause", {"mode": "sideways"}, None],
        ["GET", "/is_paused", None, None],
        ["GET", "/get_world_size", None, None],
        ["GET", "/get_world_size", {"include_dp": "false"}, None],
        ["POST", "/weight_checker", None, {"action": "checksum"}],
        ["POST", "/weight_checker", None, {"action": "compare", "baseline": ours}],
        ["POST", "/weight_checker", None, {"action": "compare", "baseline": changed}],
        ["POST", "/weight_checker", None, {"action": "compare", "baseline": one_sided}],  # names on one side only
        ["POST", "/weight_checker", None, {"action": "compare", "baseline": {}}],
        ["POST", "/weight_checker", None, {"action": "compare"}],
        ["POST", "/weight_checker", None, {"action": "nonsense"}],
        ["POST", "/shutdown_weight_transfer_engine", None, None],
        ["POST", "/weight_checker", None, {"action": "reset"}],
    ]
    theirs = vllm_answers(vllm_python, ours, requests)
    with httpx.Client(base_url=url, timeout=60) as c:
        mine = []
        for method, path, params, body in requests:
            r = c.request(method, path, params=params, json=body)
            mine.append([r.status_code, r.json()])
    for req, (s1, b1), (s2, b2) in zip(requests, theirs, mine):
        assert comparable(s2, b2) == comparable(s1, b1), (req, (s1, b1), (s2, b2))
    # the cases this covers really differ from one another (a test that compared nothing would pass too)
    compares = [b for (_, b), r in zip(theirs, requests) if r[2:] and (r[3] or {}).get("action") == "compare"]
    assert [c.get("match") for c in compares[:4]] == [True, False, False, False]
    assert sorted(compares[2]["mismatches"]) == sorted([name, "dp0:pp0:pcp0:tp0:not.in.the.model"])
    assert theirs[8][0] == 400 and theirs[17][0] == 400
    # our reset zeroed the served weights, as vLLM's zero_weights does
    after = httpx.post(f"{url}/weight_checker", json={"action": "checksum"}, timeout=60).json()["checksums"]
    assert after != ours
