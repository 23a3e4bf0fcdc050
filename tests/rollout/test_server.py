"""The rollout API on the real broker: submit, validation, progress, early stop, cancel, the CLI."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from typer.testing import CliRunner

from polarstream.cli import app as cli_app
from schemas import SessionAssigned, SessionEvent, TaskRequest, decode
from schemas.session_keys import verify_session_key
from tests.streams.helpers import publish, read_topic

pytestmark = pytest.mark.integration

TASK = {"task_id": "api-1", "instruction": "do it", "num_samples": 3, "min_valid": 1, "early_stop": 2}


def wait_for(fn, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = fn()
        if out:
            return out
        time.sleep(0.2)
    raise AssertionError("condition not met in time")


def finished(i: int, reward: float, attempt: int = 0) -> SessionEvent:
    sid = f"api-1.s{i}" + (f".a{attempt}" if attempt else "")
    return SessionEvent(session_id=sid, group_id="api-1", task_id="api-1", sample_index=i, attempt=attempt, kind="finished",
                        status="ok", reward=reward, num_calls=2, num_samples=3)


def test_submit_fans_out_and_early_stop_cancels_the_rest(polar_settings, rollout_server):
    url = rollout_server.url
    r = httpx.post(f"{url}/tasks", json=TASK)
    assert r.status_code == 202 and r.json()["sessions"] == ["api-1.s0", "api-1.s1", "api-1.s2"]
    # 202 means durable: the sessions are on polar.sessions with keys scoped to them
    msgs = read_topic(polar_settings, "sessions", until=lambda ms: len(ms) >= 3, timeout=30)
    sessions = sorted((decode(m.value, SessionAssigned) for m in msgs), key=lambda s: s.sample_index)
    assert [verify_session_key(s.session_key, polar_settings.session_secret).session_id for s in sessions] == \
        ["api-1.s0", "api-1.s1", "api-1.s2"]
    assert httpx.post(f"{url}/tasks", json=TASK).json()["error"]["code"] == "duplicate_task"

    # what nodes report: sample 0 ok, sample 1 re-run (attempt 1) ok -> 2 usable = early_stop
    publish(polar_settings, [finished(0, 1.0), finished(1, 0.0, attempt=1)])
    status = wait_for(lambda: (s := httpx.get(f"{url}/tasks/api-1").json())["usable"] == 2 and s)
    assert status["finished"] == 2 and status["retried"] == 1 and status["samples"]["1"]["session_id"] == "api-1.s1.a1"
    markers = read_topic(polar_settings, "tasks", until=lambda ms: any(decode(m.value, TaskRequest).cancelled for m in ms), timeout=30)
    cancel = [decode(m.value, TaskRequest) for m in markers if decode(m.value, TaskRequest).cancelled]
    assert cancel[0].task_id == "api-1" and cancel[0].cancelled.startswith("early_stop")
    assert wait_for(lambda: httpx.get(f"{url}/tasks/api-1").json()["state"] == "cancelled")


def test_bad_input_is_refused_in_the_api_shape(rollout_server):
    url = rollout_server.url
    bad = httpx.post(f"{url}/tasks", json={**TASK, "num_samples": 0})
    assert bad.status_code == 400 and "num_samples" in bad.json()["error"]["message"]
    mix = httpx.post(f"{url}/tasks", json={**TASK, "task_id": "m", "harness": {"name": "mix", "config": {"harnesses": []}}})
    assert mix.status_code == 400 and "non-empty list" in mix.json()["error"]["message"]
    assert httpx.get(f"{url}/tasks/nope").status_code == 404
    assert httpx.delete(f"{url}/tasks/nope").json()["error"]["code"] == "unknown_task"
    assert httpx.get(f"{url}/tasks").json() == []  # nothing was recorded by the refused submissions
    assert "/tasks/{task_id}" in httpx.get(f"{url}/openapi.json").json()["paths"]


def test_cli_submit_status_cancel(polar_settings, rollout_server, tmp_path):
    runner = CliRunner()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**TASK, "task_id": "c1"}) + "\n" + json.dumps({"task_id": "c2"}) + "\n")
    res = runner.invoke(cli_app, ["submit", str(bad), "--url", rollout_server.url])
    assert res.exit_code == 1 and f"{bad}:2: instruction: Field required" in res.output
    assert httpx.get(f"{rollout_server.url}/tasks").json() == []  # a bad file submits nothing
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({**TASK, "task_id": "c1"}) + "\n\n" + json.dumps({**TASK, "task_id": "c2", "num_samples": 2}) + "\n")
    res = runner.invoke(cli_app, ["submit", str(good), "--url", rollout_server.url])
    assert res.exit_code == 0, res.output
    assert "submitted c1: 3 sessions" in res.output and "submitted c2: 2 sessions" in res.output
    res = runner.invoke(cli_app, ["status", "--url", rollout_server.url])
    assert res.exit_code == 0 and "c1" in res.output and "finished 0/3" in res.output
    res = runner.invoke(cli_app, ["cancel", "c2", "--url", rollout_server.url, "--reason", "operator"])
    assert res.exit_code == 0 and "cancelled c2" in res.output
    res = runner.invoke(cli_app, ["status", "c2", "--url", rollout_server.url, "--json"])
    assert json.loads(res.output)["cancelled"] == "operator"
    res = runner.invoke(cli_app, ["cancel", "nope", "--url", rollout_server.url])
    assert res.exit_code == 1 and "is not known to this server" in res.output
