"""Fixtures for the viewer: a short real run recorded in Kafka, and the viewer serving it.

``recorded_run`` (session scope, started once): its own topic prefix; the real gateway (in-process, on
the shared scripted tiny engine) records two sessions of one group through the OpenAI SDK, the second
with a side call (a title request) and a chain break (its system prompt changes); finished events go
to polar.session-events; a real streams worker turns them into trajectories and a TrainingGroup; the
viewer reads all of it through its own reader and serves it on a free port. Handle: ``.viewer_url``,
``.group_id``, ``.sessions`` (sample index -> session id), ``.run`` (the RunIndex).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

BREAK_SYSTEM = "You write files carefully."  # a new system prompt: the gateway starts a new chain


@dataclass
class RecordedRun:
    settings: object
    viewer_url: str
    group_id: str
    sessions: dict[int, str]
    run: object  # polarstream.viewer.index.RunIndex
    base: Path


def _second_session_extras(gw, session_id: str, group_id: str, task_id: str) -> None:
    """A title side call, then a call whose system prompt changed (a chain break the gateway names)."""
    import openai

    from tests.plugins.gateway import WRITE_FILE

    key = gw.key(session_id, group_id=group_id, task_id=task_id, sample_index=1)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key)
    client.chat.completions.create(model="m", messages=[
        {"role": "system", "content": "You are a title generator. Answer with a title."},
        {"role": "user", "content": "Create hello.txt containing hi"}])
    client.chat.completions.create(model="m", tools=[WRITE_FILE], messages=[
        {"role": "system", "content": BREAK_SYSTEM}, {"role": "user", "content": "Check hello.txt contains hi"}])


@pytest.fixture(scope="session")
def recorded_run(infra, scripted_engine, tiny_model_dir, tiny_template, tmp_path_factory):
    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from gateway.redact import token_decoder
    from gateway.server import ThreadedServer
    from infra.topics import ensure_topics
    from tests.plugins.infra import drop_topics
    from polarstream.viewer.app import create_app as create_viewer
    from polarstream.viewer.index import RunIndex
    from polarstream.viewer.reader import Reader
    from schemas import SessionEvent
    from tests.plugins.gateway import run_tool_session
    from tests.streams.helpers import WorkerProcess, publish

    base = tmp_path_factory.mktemp("viewer-run")
    tag = uuid.uuid4().hex[:10]
    settings = infra.settings.model_copy(update={"topic_prefix": f"v{tag}.", "data_dir": base / "polar"})
    settings.data_dir.mkdir(parents=True)
    ensure_topics(settings)
    # The worker starts first: its group join overlaps the calls below.
    worker = WorkerProcess(settings, base / "worker.log", ["--missing-calls-grace", "2", "--tick-interval", "1"]).start()
    run = RunIndex(settings.topic_prefix)
    reader = Reader(settings, run, poll_s=0.2)
    reader.start()
    gateway = ThreadedServer(create_app(settings, GatewayConfig(engine_urls=[scripted_engine.url], model=str(tiny_model_dir)),
                                        template=tiny_template)).start()
    viewer = ThreadedServer(create_viewer([run], decode=token_decoder(tiny_template.tokenizer))).start()
    try:
        gw = gateway
        gw.key = lambda sid, **claims: _key(settings, sid, **claims)
        group_id, task_id = f"g-{tag}", f"t-{tag}"
        sessions = {0: f"s0-{tag}", 1: f"s1-{tag}"}
        for i, sid in sessions.items():
            run_tool_session(gw, sid, i, group_id, task_id)
        _second_session_extras(gw, sessions[1], group_id, task_id)
        now = time.time()
        publish(settings, [SessionEvent(session_id=sid, group_id=group_id, task_id=task_id, sample_index=i, num_samples=2,
                                        min_valid=2, kind="finished", status="ok", reward=float(i == 0),
                                        num_calls=3 + 2 * i, harness="sdk", created_at=now + 1)
                           for i, sid in sessions.items()])
        deadline = time.monotonic() + 90
        while group_id not in run.groups:
            assert worker.alive(), f"streams worker died:\n{worker.log_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no group after 90s; worker log:\n{worker.log_text()[-3000:]}"
            time.sleep(0.2)
        yield RecordedRun(settings, viewer.url, group_id, sessions, run, base)
    finally:
        reader.stop()
        viewer.stop()
        gateway.stop()
        worker.stop()
        drop_topics(settings)


def _key(settings, session_id: str, **claims) -> str:
    from schemas.session_keys import mint_session_key

    return mint_session_key(session_id, settings.session_secret, **claims)
