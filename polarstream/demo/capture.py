"""Capture a real CLI's conversation shape through the gateway: one scripted session, then its records.

The engine runs in scripted mode (docs/engine.md): it answers the task's message by writing answer.txt
with the CLI's file tool, and anything else with "Done.". The session runs like any other (rollout server,
gateway node, sandbox) on topics of its own, so nothing of it reaches the run's streams or trainer; its
first ``CallRecorded`` and the first one carrying the write's result hold the CLI's normalized requests. The result is cached by CLI, API and the
CLI's installed version, so an upgraded CLI is captured again (and so gets a new warm start: the
capture is part of the warm-start cache key).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import httpx
import yaml

from infra.process import free_port
from infra.settings import Settings
from polarstream.driver.processes import Processes, ProcessFailed
from schemas import CallRecorded, HarnessSpec

from . import arith
from .shape import CAPTURE_CONTENT, CAPTURE_QUESTION, Shape, api_option, write_tool


def cli_version(harness: str, settings: Settings) -> str:
    """The CLI's installed version, installing the pinned one first when it is absent."""
    from gateway.harnesses.install import install

    report = install(harness, settings.cache_dir, log=lambda _: None)
    if report["status"] == "failed":
        raise ProcessFailed(f"cannot install {harness}: {report['detail']}")
    return report["version"]


def capture(harness: str, api: str, settings: Settings, env: dict[str, str], run_dir: Path, model_dir: Path,
            runtime: str) -> Shape:
    """The CLI's shape, from the cache or from one scripted session (about 20-40 s)."""
    version = cli_version(harness, settings)
    cached = settings.cache_dir / "captures" / f"{harness}-{api}-{version}.json"
    if cached.exists():
        return Shape.from_json(json.loads(cached.read_text()))
    from infra.stack import Stack

    tool, path_key = write_tool(harness)
    prefix = f"{settings.topic_prefix}capture."
    Stack(settings.model_copy(update={"topic_prefix": prefix})).up()
    script = run_dir / "capture-script.yaml"
    # The write answers the task's own message, wherever the CLI puts it: counting turns would not do, as
    # Qwen Code opens with a scripted exchange of its own ("Got it. Thanks for the context!").
    script.write_text(yaml.safe_dump({"turns": [
        {"match": re.escape(arith.instruction(CAPTURE_QUESTION, tool)),
         "tool_calls": [{"name": tool, "arguments": {path_key: arith.ANSWER_FILE, "content": CAPTURE_CONTENT}}]}],
        "fallback": {"text": "Done."}, "skip_system": True}))
    procs = Processes(run_dir / "logs" / "capture", {**env, "POLAR_TOPIC_PREFIX": prefix})
    ports = {name: free_port() for name in ("engine", "gateway", "rollout")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    try:
        engine = procs.start("engine", "engine", "--model", str(model_dir), "--port", str(ports["engine"]),
                             "--script", str(script), "--threads", "1")
        procs.wait_http(engine, f"{urls['engine']}/health")
        node = procs.start("node", "node", "--engine-url", urls["engine"], "--model", str(model_dir), "--runtime", runtime,
                           "--port", str(ports["gateway"]), "--run-workers", "1", "--ready-target", "1")
        procs.wait_http(node, f"{urls['gateway']}/health")
        rollout = procs.start("rollout", "rollout", "--port", str(ports["rollout"]))
        procs.wait_http(rollout, f"{urls['rollout']}/health")
        task = arith.task_request(CAPTURE_QUESTION, CAPTURE_CONTENT, task_id=f"capture-{harness}-{api}", num_samples=1,
                                       harness=HarnessSpec(name=harness, config=api_option(harness, api)),
                                       task_set="demo-capture", tool=tool)
        httpx.post(f"{urls['rollout']}/tasks", json=[task.model_dump(mode="json")], timeout=60).raise_for_status()
        deadline = time.monotonic() + 180
        while not httpx.get(f"{urls['rollout']}/tasks/{task.task_id}", timeout=10).json().get("finished"):
            procs.check_all()
            if time.monotonic() > deadline:
                raise ProcessFailed(f"capturing {harness}: the scripted session did not finish in 180 s; logs in {procs.log_dir}")
            time.sleep(1)
        calls = _calls(settings.model_copy(update={"topic_prefix": prefix}), task.task_id)
    finally:
        procs.stop_all()
    shape = _shape(harness, api, version, calls, procs.log_dir)
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_name(f".{cached.name}.{os.getpid()}")
    partial.write_text(json.dumps(shape.to_json(), indent=1))
    partial.replace(cached)  # atomic: a concurrent capture (another test process) never reads half a file
    return shape


def _calls(settings: Settings, task_id: str, timeout: float = 30.0) -> list[CallRecorded]:
    """The task's main-loop calls (side calls such as titles left out), by call index, up to the first
    that carries a tool result."""
    from producers.consumer import RecordConsumer

    consumer = RecordConsumer(settings, topics=["calls"], group_id=f"polar-capture-{time.monotonic_ns()}")
    found: dict[int, CallRecorded] = {}
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not any(map(_has_tool_result, found.values())):
            for item in consumer.poll(1.0):
                rec = item.record
                if isinstance(rec, CallRecorded) and rec.task_id == task_id and not rec.side_call:
                    found[rec.call_index] = rec
    finally:
        consumer.close()
    return [found[i] for i in sorted(found)]


def _has_tool_result(call: CallRecorded) -> bool:
    return any(m["role"] == "tool" for m in call.request.get("messages", []))


def _shape(harness: str, api: str, version: str, calls: list[CallRecorded], logs: Path) -> Shape:
    # The first call, and the first one after the write's result: a CLI may re-send its first request
    # before that (Gemini CLI retries it), which adds nothing.
    after = next((c for c in calls[1:] if _has_tool_result(c)), None)
    if not calls or after is None:
        raise ProcessFailed(f"capturing {harness}: expected a call that writes answer.txt, then one after its result; "
                            f"recorded {len(calls)} without the second; logs in {logs}")
    first, second = calls[0].request, after.request
    full = first["messages"][: second.get("messages_offset", 0)] + second["messages"]
    last_assistant = max((i for i, m in enumerate(full) if m["role"] == "assistant"), default=len(full))
    write = full[last_assistant] if last_assistant < len(full) else {}
    if not write.get("tool_calls") or not any(m["role"] == "tool" for m in full[last_assistant + 1:]):
        raise ProcessFailed(f"capturing {harness}: its second call did not carry the write call's result; logs in {logs}")
    return Shape(harness=harness, api=api, version=version, first=first["messages"],
                 after_write=full[last_assistant + 1:], tools=first.get("tools") or [],
                 write_call_id=write["tool_calls"][0]["id"])
