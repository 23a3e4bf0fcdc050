"""``polarstream gateway --processes 2``: every call of a session reaches one process, so chains merge;
admin writes reach every process; the workers die with the router.

One gateway (two worker processes and the router) serves the whole module, against the vLLM-shaped
stub engine of bench/gateway.py (it answers every call with the same tool call, instantly) and the
test session's Kafka.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import httpx
import pytest

from bench._procs import spawn, stop, wait_http
from bench.gateway import CALL, Conversation, make_world, tool_call_id
from gateway.router import _label_worker, merge_json
from infra.process import free_port
from infra.topics import delete_topics, ensure_topics
from tests.plugins.gateway import CallsReader
from tests.plugins.rollout import settings_env
from tests.streams.helpers import PolarProcess

REPO = Path(__file__).resolve().parents[2]
SESSIONS, CALLS_EACH = 8, 3


@pytest.fixture(scope="module")
def settings(infra, tmp_path_factory):
    """The module's own topic prefix (the gateway runs across its tests)."""
    tag = uuid.uuid4().hex[:10]
    s = infra.settings.model_copy(update={"topic_prefix": f"t{tag}.", "data_dir": tmp_path_factory.mktemp("router")})
    ensure_topics(s)
    yield s
    delete_topics(s, timeout=10)


@pytest.fixture(scope="module")
def stub_engine(tiny_template, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stub")
    eot = [tiny_template.eot.token_id]
    (tmp / "stub.json").write_text(json.dumps({"completion_ids": tiny_template.encode(
        "<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>") + eot}))
    port = free_port()
    proc = spawn([sys.executable, str(REPO / "bench/gateway.py"), "--serve-stub", str(port), str(tmp / "stub.json")], tmp / "stub.log")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc)
    yield url
    stop([proc], timeout=5)


def start_gateway(settings, engine_url: str, model_dir, log: Path, *extra: str) -> tuple[PolarProcess, int]:
    port = free_port()
    proc = PolarProcess(["gateway", "--processes", "2", "--engine-url", engine_url, "--model", str(model_dir),
                         "--port", str(port), *extra], settings_env(settings), log, stop_timeout_s=30).start()
    return proc, port


@pytest.fixture(scope="module")
def gateway(settings, stub_engine, tiny_model_dir, tmp_path_factory):
    proc, port = start_gateway(settings, stub_engine, tiny_model_dir, tmp_path_factory.mktemp("gw") / "gateway.log")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc.proc, timeout=90)
    yield proc, url
    proc.stop()


def admin(settings, url: str, method: str, path: str, **kw) -> httpx.Response:
    r = httpx.request(method, url + path, headers={"Authorization": f"Bearer {settings.admin_token}"}, timeout=30, **kw)
    assert r.status_code == 200, r.text
    return r


async def interleaved_sessions(url: str, settings) -> dict[str, list[str]]:
    """SESSIONS sessions of CALLS_EACH streamed Chat calls, sent round by round over 3 shared keep-alive
    connections (so one connection carries calls of many sessions); session -> the worker of each call."""
    from schemas.session_keys import mint_session_key

    world = make_world()
    world.update(system=world["system"][:2000], task=world["task"][:500])  # small calls: the test is about routing
    convs = {f"route-{i}": Conversation(world, "chat", 10**9) for i in range(SESSIONS)}
    seen: dict[str, list[str]] = defaultdict(list)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=3)) as http:
        async def call(sid: str) -> None:
            key = mint_session_key(sid, settings.session_secret)
            r = await http.post("/v1/chat/completions", json=convs[sid].body(), headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            assert r.headers["content-type"].startswith("text/event-stream")
            seen[sid].append(r.headers["x-polar-worker"])
            convs[sid].advance(tool_call_id(r.content, sse=True))

        for _ in range(CALLS_EACH):
            await asyncio.gather(*(call(sid) for sid in convs))
    return seen


def test_calls_of_a_session_reach_one_process_and_chain(gateway, settings):
    _, url = gateway
    seen = asyncio.run(interleaved_sessions(url, settings))
    assert all(len(set(workers)) == 1 for workers in seen.values()), seen
    assert {w[0] for w in seen.values()} == {"0", "1"}  # both processes served sessions

    reader = CallsReader(settings)
    try:
        events = reader.wait(SESSIONS * CALLS_EACH)
    finally:
        reader.close()
    by_session = defaultdict(list)
    for e in events:
        by_session[e.session_id].append(e)
    assert sorted(by_session) == sorted(seen)
    for sid, calls in by_session.items():  # one process kept the chain: indexes 0..n-1, each extends the last
        assert [c.call_index for c in calls] == list(range(CALLS_EACH)), sid
        assert [c.chain.extends_call_index for c in calls] == [None, *range(CALLS_EACH - 1)], sid

    stats = admin(settings, url, "GET", "/admin/sessions/route-0").json()  # reaches the session's owner
    assert stats["known"] and stats["num_calls"] == CALLS_EACH and stats["merged"] == CALLS_EACH - 1
    status = admin(settings, url, "GET", "/admin/status").json()
    assert status["processes"] == 2 and status["sessions"] == SESSIONS  # none counted twice: no chain was split


def test_admin_writes_reach_every_process(gateway, settings):
    _, url = gateway
    paused = admin(settings, url, "POST", "/admin/pause").json()
    assert paused["paused"] and paused["drained"] and [w["paused"] for w in paused["workers"]] == [True, True]
    assert paused["resumes_by_itself_in_s"] == 900  # every worker's deadline, not their sum
    assert admin(settings, url, "POST", "/admin/policy_version", json={"version": 7}).json()["version"] == 7
    status = admin(settings, url, "GET", "/admin/status").json()
    assert [(w["paused"], w["policy_version"]) for w in status["workers"]] == [(True, 7), (True, 7)]
    resumed = admin(settings, url, "POST", "/admin/resume").json()
    assert not resumed["paused"] and [w["paused"] for w in resumed["workers"]] == [False, False]

    health = httpx.get(url + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["processes"] == 2 and health["policy_version"] == 7
    assert [w["worker"] for w in health["workers"]] == [0, 1]
    refused = httpx.post(url + "/admin/pause", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert refused.status_code == 401
    unkeyed = httpx.post(url + "/v1/messages", json={"model": "m", "max_tokens": 5, "messages": []},
                         headers={"anthropic-version": "2023-06-01"}, timeout=10)
    assert unkeyed.status_code == 401 and unkeyed.json()["type"] == "error"  # the worker's own Anthropic-shaped 401


def test_metrics_of_every_worker_are_labelled():
    assert _label_worker("polar_gateway_sessions 3.0", 1) == 'polar_gateway_sessions{worker="1"} 3.0'
    assert _label_worker('polar_gateway_calls_total{provider="chat",status="ok"} 4.0', 0) == \
        'polar_gateway_calls_total{worker="0",provider="chat",status="ok"} 4.0'


def test_counts_per_adapter_are_summed_over_workers():
    answers = [httpx.Response(200, json={"in_flight": {"a-v3": 2}, "stamped": {"": "a-v3"}}),
               httpx.Response(200, json={"in_flight": {"a-v3": 1, "b-v7": 4}, "stamped": {"": "a-v3"}})]
    merged = json.loads(merge_json(answers)[0])
    assert merged["in_flight"] == {"a-v3": 3, "b-v7": 4} and merged["stamped"] == {"": "a-v3"}


def test_workers_die_with_the_router(gateway):
    proc, _ = gateway
    children = [int(p) for p in Path(f"/proc/{proc.proc.pid}/task/{proc.proc.pid}/children").read_text().split()]
    assert len(children) >= 2  # the two workers (and spawn's resource tracker)
    proc.kill()
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if _alive(pid)]


def test_a_worker_that_cannot_start_stops_the_command_with_one_line(settings, stub_engine, tmp_path):
    broken = tmp_path / "model"
    broken.mkdir()
    (broken / "tokenizer_config.json").write_text("{}")  # passes the CLI's check; the worker cannot load it
    proc, _ = start_gateway(settings, stub_engine, broken, tmp_path / "gateway.log")
    assert proc.proc.wait(90) != 0
    errors = [line for line in proc.log_text().splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: gateway worker ") and "did not start" in errors[0], \
        proc.log_text()[-2000:]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/status").read_text() if Path(f"/proc/{pid}/status").exists() else ""
    return "State:\tZ" not in state
