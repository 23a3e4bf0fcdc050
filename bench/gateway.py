"""Gateway overhead: added latency over calling the engine directly, and calls/s under concurrency.

Everything runs on this machine, each server in its own process:
- a vLLM-shaped stub engine (stdlib, Nagle off) answering /v1/completions with token ids + logprobs and
  /v1/chat/completions (JSON or SSE) with a fixed tool call, so the numbers are gateway cost, not model time;
- a single-node Kafka broker (ours records every call durably, acks=all, before answering);
- our gateway (``polarstream gateway``, sync publish), once as one process and once as
  ``--processes 2`` (the session router in front of two gateway processes, gateway/router.py), and, where
  they install (separate venvs under ~/.cache/polarstream/peers, never .venv), rllm-model-gateway and
  Agent Lightning's gateway.

Load plan: clients replay agent sessions of realistic size: a ~30 KB first request (system prompt, 20 tools,
task), each turn appending the echoed tool call and a ~2.3 KB tool result, a new session past ~80 KB.
Latency is measured at 1 client (to the end of the streamed body); calls/s at 1, 16 and 64 concurrent clients.

Two 1-client scenarios time one kind of call only, on the targets that stream Chat or Anthropic:
- ``extend_80kb``: a call of 75-86 KB that extends its session's previous call. Each session's first
  call (~73 KB of history, untimed) warms it; the calls after it, each appending a turn, are timed.
- ``fresh_80kb``: a session's first call of ~80 KB whose system prompt and tools (~72 KB) the gateway
  has seen before: one session of the task is sent untimed, then the first calls of new sessions, each
  with its own short task, are timed.
Their p50/p99 are over the calls of every round pooled; *added* is ours minus the engine called directly
with the same bodies.

Targets run in interleaved rounds (bench/_rounds.py): each round runs every target's whole load plan (and
its scenarios) once, in the same order, so a load change hits all of them alike; calls/s and load-plan
latencies are medians over rounds, and ``rounds`` keeps min, spread and CPU/wall per pass (CPU of this
client and of every server process, worker processes included). A target is named ``<server>.<mode>``;
its mode is what was measured (``chat_stream``: Chat SSE, ``chat_json``: Chat non-streaming). Agent
Lightning rejects streaming, so it is measured as ``chat_json`` beside ``polarstream.chat_json``, never
in a ``chat_stream`` row.

The JSON's top level carries the figures issue 19 asks for: ``added_latency_ms_p50``/``_p99``
(extend_80kb, polarstream.chat_stream minus the engine), ``fresh_call_added_ms_p50``,
``calls_per_s_16_clients`` (polarstream.chat_stream, 1 process), ``calls_per_s_16_clients_2_processes``
and ``peer_calls_per_s_16_clients`` (rllm-model-gateway.chat_stream; null, with
``peer_calls_per_s_16_clients_reason``, when it is not installed). Beside them, where extend_80kb's
time goes: ``added_latency_ms_mean`` and ``added_latency_stages_ms_mean``, the gateway's own mean ms per
call in each stage of its pipeline (``polar_gateway_stage_seconds`` from its /metrics, read around each
session's timed calls); what the stages leave of the mean is HTTP, parsing the request and rendering the answer.

Issue 47's bars against rllm-model-gateway, from the same rounds, all at the top level (``versus_peer``):
``gateway_calls_per_s_vs_peer_16`` and ``_64`` (ours ÷ peer, calls/s), ``gateway_cpu_ms_per_call_vs_peer``
(each server process's own CPU counters over its 16-client loads, per call; ``gateway_cpu_ms_per_call`` and
``peer_cpu_ms_per_call`` beside it) and ``gateway_added_p50_less_ack_vs_peer`` (extend_80kb's added p50 less
the publish stage, the wait for Kafka's acknowledgement: ``gateway_publish_ack_ms_mean``).

That stub charges a Chat prompt nothing, which no real engine does: vLLM renders and tokenizes every text
prompt it is sent, and a gateway that forwards text leaves that to it, while ours tokenizes only the new
turn and sends ids. So the same race also runs in front of a *vLLM-like* stub (``serve_stub`` with a
tokenizer; targets ``<server>@vllm_like.<mode>``): ours and the peer end to end, the harness's view
(``versus_peer_vllm_like``: ``vllm_like_gateway_p50_vs_peer_80kb``, ``vllm_like_gateway_calls_per_s_vs_peer_16``
and ``_64``, and ``vllm_like_engine_tokenize_ms_p50_80kb``, what the engine spends on a forwarded 80 KB call).

    .venv/bin/python bench/gateway.py [--quick] [--bootstrap HOST:PORT]
"""

from __future__ import annotations

MEASURES = ('gateway/', 'producers/', 'schemas/', 'engine/')  # the code these figures describe (bench/_provenance.py)

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._procs import kafka_for_bench, server_env, spawn, stop, wait_http  # after the path insert: run as a script
from bench._rounds import interleaved, proc_cpu_s  # noqa: E402
PEERS = Path.home() / ".cache" / "polarstream" / "peers"


def install_peer(venv: str, package: str, exe: str) -> None:
    """The peer's own venv under PEERS, made once: a bench that compares with a peer installs it first (a
    rerun without it wrote null over the measured comparison, 2d10f31). A failed install leaves the peer
    "not installed" in the results; our .venv is never touched."""
    if (PEERS / venv / "bin" / exe).exists():
        return
    try:
        subprocess.run([shutil.which("python3.11") or "python3", "-m", "venv", str(PEERS / venv)], check=True,
                       capture_output=True, timeout=120)
        subprocess.run([str(PEERS / venv / "bin" / "pip"), "install", "-q", package], check=True, capture_output=True,
                       timeout=600)
    except (subprocess.SubprocessError, OSError) as e:
        print(f"could not install the peer {package}: {e}", file=sys.stderr)


CALL = {"name": "Bash", "arguments": {"command": "ls -la src/ && git status --short", "description": "List files"}}
WORDS = ("the file function value return error test module import class config server request session token "
         "build output input path line change commit branch merge python shell command directory list").split()


# ------------------------------------------------------------------------------------ stub engine


def serve_stub(port: int, spec_file: str, tokenizer_dir: str = "") -> None:
    """The stub engine process: fixed completion ids for /v1/completions, a fixed tool call for chat.

    With ``tokenizer_dir`` it is *vLLM-like*: a Chat request is rendered with the model's chat template and
    tokenized, as vLLM's OpenAI server does with every text prompt before it schedules it (the ids are its
    ``prompt_token_ids``), while a /v1/completions prompt of token ids is taken as is, as vLLM takes it.
    A gateway that forwards text leaves that work to the engine; ours sends ids and does it itself.

    Served as vLLM serves its API: one asyncio process under uvicorn (uvloop, httptools). A thread per
    connection (http.server) collapsed under 64 clients (64 threads contending for one GIL: 50 calls/s
    direct, against 170 at 16), so the 64-client figures measured the stub, not the gateways in front
    of it. orjson on both routes: a real engine's JSON handling is native (vLLM: orjson/msgspec), and
    stdlib json on a 15k-id prompt and its echo cost the stub ~2 ms that the Chat route (the direct
    baseline) does not pay, which would be counted as the gateway's."""
    import orjson
    import uvicorn

    spec = json.loads(Path(spec_file).read_text())
    ids, call_args = spec["completion_ids"], json.dumps(CALL["arguments"])
    tokenize = _chat_tokenizer(tokenizer_dir) if tokenizer_dir else None
    models = orjson.dumps({"object": "list", "data": [{"id": "stub-model", "max_model_len": 262144}]})

    def answer(path: str, req: dict) -> tuple[bytes, bytes]:
        if path.endswith("/v1/completions"):
            choice = {"index": 0, "text": "", "token_ids": ids, "prompt_token_ids": req["prompt"], "finish_reason": "stop",
                      "stop_reason": None, "logprobs": {"token_logprobs": [-0.5] * len(ids), "tokens": [""] * len(ids)}}
            return orjson.dumps({"id": "cmpl-1", "object": "text_completion", "model": "stub-model",
                                 "choices": [choice], "policy_version": 0}), b"application/json"
        prompt_ids = tokenize(req) if tokenize else None
        n_prompt = len(prompt_ids) if prompt_ids is not None else len(orjson.dumps(req.get("messages", []))) // 4
        tool_call = {"id": "call_stub", "type": "function", "function": {"name": "Bash", "arguments": call_args}}
        token_data = {"token_ids": ids} if req.get("return_token_ids") else {}
        if not req.get("stream"):
            body = {"id": "chatcmpl-1", "object": "chat.completion", "model": req.get("model"),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                                 "finish_reason": "tool_calls", **token_data}],
                    "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(ids), "total_tokens": n_prompt + len(ids)},
                    **({"prompt_token_ids": prompt_ids or list(range(n_prompt))} if req.get("return_token_ids") else {})}
            return orjson.dumps(body), b"application/json"
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                  {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, **tool_call}]}, **token_data}]},
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}]
        body = b"".join(b"data: " + orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", **c}) + b"\n\n"
                        for c in chunks)
        return body + b"data: [DONE]\n\n", b"text/event-stream"

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan: nothing to set up
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
                await receive()
                await send({"type": "lifespan.shutdown.complete"})
            return
        chunks, more = [], True
        while more:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        if scope["method"] == "GET":
            body, ctype = (models if "models" in scope["path"] else b'{"status":"ok"}'), b"application/json"
        else:
            body, ctype = answer(scope["path"], orjson.loads(b"".join(chunks)))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop="uvloop",
                http="httptools", backlog=1024)


def _chat_tokenizer(tokenizer_dir: str):
    """Chat request -> prompt ids the way vLLM's server makes them: tool-call arguments parsed to objects
    for the template, the template rendered to text, the text tokenized without added special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    backend = tok.backend_tokenizer

    def tokenize(req: dict) -> list[int]:
        messages = []
        for m in req.get("messages", []):
            if m.get("tool_calls"):
                m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                         for c in m["tool_calls"]]}
            messages.append(m)
        text = tok.apply_chat_template(messages, tools=req.get("tools") or None, add_generation_prompt=True, tokenize=False)
        return backend.encode(text, add_special_tokens=False).ids
    return tokenize


# ------------------------------------------------------------------------------------ workload


def _text(rng: random.Random, n_bytes: int) -> str:
    out, size = [], 0
    while size < n_bytes:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def make_world(seed: int = 0) -> dict:
    """System prompt (~6 KB), 20 tools (~1 KB each) and a first user message (~4 KB): ~30 KB together."""
    rng = random.Random(seed)
    tools = [{"name": f"tool_{i}" if i else "Bash", "description": _text(rng, 600), "input_schema": {
        "type": "object", "properties": {f"p{j}": {"type": "string", "description": _text(rng, 60)} for j in range(4)}}}
        for i in range(20)]
    return {"system": _text(rng, 6000), "tools": tools, "task": _text(rng, 4000), "result": _text(rng, 2300)}


def make_fresh_world(seed: int = 1) -> dict:
    """A task whose system prompt (~26 KB) and 40 tools (~42 KB as Chat tools) are ~72 KB: with a session's
    own task (~5 KB, session_task) its first call is ~80 KB."""
    world = make_world(seed)
    rng = random.Random(seed)
    world["system"] = _text(rng, 26_000)
    world["tools"] = [{"name": f"tool_{i}" if i else "Bash", "description": _text(rng, 650), "input_schema": {
        "type": "object", "properties": {f"p{j}": {"type": "string", "description": _text(rng, 60)} for j in range(4)}}}
        for i in range(40)]
    return world


def session_task(world: dict, n: int) -> dict:
    """The world with session ``n``'s own task (~5 KB): same system prompt and tools, new user text."""
    return {**world, "task": f"Task {n}: " + _text(random.Random(n), 5000)}


class Conversation:
    """One agent session's growing history in Anthropic or Chat form."""

    def __init__(self, world: dict, provider: str, max_bytes: int):
        self.world, self.provider, self.max_bytes = world, provider, max_bytes
        self.turns: list[str] = []  # tool-call ids the client echoed

    def body(self) -> dict:
        w = self.world
        if self.provider == "anthropic":
            msgs: list[dict] = [{"role": "user", "content": w["task"]}]
            for cid in self.turns:
                msgs += [{"role": "assistant", "content": [{"type": "tool_use", "id": cid, "name": CALL["name"], "input": CALL["arguments"]}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": cid, "content": w["result"]}]}]
            return {"model": "claude-opus-4-8", "max_tokens": 1024, "system": w["system"], "messages": msgs,
                    "tools": w["tools"], "stream": True}
        msgs = [{"role": "system", "content": w["system"]}, {"role": "user", "content": w["task"]}]
        for cid in self.turns:
            msgs += [{"role": "assistant", "content": None, "tool_calls": [{"id": cid, "type": "function", "function": {
                "name": CALL["name"], "arguments": json.dumps(CALL["arguments"], separators=(",", ":"))}}]},
                     {"role": "tool", "tool_call_id": cid, "content": w["result"]}]
        tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
                 for t in w["tools"]]
        return {"model": "stub-model", "messages": msgs, "tools": tools, "stream": True}

    def prefill(self, below_bytes: int) -> "Conversation":
        """Add earlier turns (as if from a previous run) until one more would reach ``below_bytes``."""
        while True:
            self.turns.append(f"call_w{len(self.turns)}")
            if len(json.dumps(self.body())) >= below_bytes:
                self.turns.pop()
                return self

    def advance(self, call_id: str) -> bool:
        """Append the turn; False when the session is complete (the next one starts afresh)."""
        self.turns.append(call_id or "call_x")
        return len(json.dumps(self.body())) < self.max_bytes


def tool_call_id(raw: bytes, sse: bool) -> str:
    """The tool-call id in an answer (Anthropic or Chat, SSE or JSON)."""
    events = [ln[6:] for ln in raw.decode().splitlines() if ln.startswith("data: ") and ln != "data: [DONE]"] if sse else [raw.decode()]
    for e in events:
        d = json.loads(e)
        if (cb := d.get("content_block")) and cb.get("type") == "tool_use":
            return cb["id"]
        for ch in d.get("choices", []):
            calls = (ch.get("delta") or ch.get("message") or {}).get("tool_calls") or []
            if calls and calls[0].get("id"):
                return calls[0]["id"]
    return ""


# ------------------------------------------------------------------------------------ load


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return round(v[min(len(v) - 1, int(q * len(v)))], 2) if v else 0.0


def http_client(clients: int = 1):
    """The load generator's HTTP client: aiohttp, one keep-alive connection per client. Not httpx: its
    connection pool was the bottleneck of this bench (direct to the stub, ~310 calls/s at 16 clients and
    ~110 at 64, against ~1,100 at both with aiohttp), so every target's calls/s measured the client."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients + 8),
                                 timeout=aiohttp.ClientTimeout(total=120))


async def send(http, target: dict, session_id: str, body: dict) -> tuple[float, bytes, int, int]:
    """One call: (latency ms to the end of the body, raw answer, status, request bytes)."""
    if not target.get("stream", True):
        body["stream"] = False
    url, headers = target["url"](session_id)
    target.setdefault("sessions_used", set()).add(session_id)
    data = json.dumps(body).encode()
    t0 = time.perf_counter()
    async with http.post(url, data=data, headers={"content-type": "application/json", **headers}) as r:
        raw = await r.read()
    return (time.perf_counter() - t0) * 1000, raw, r.status, len(data)


async def forget_sessions(target: dict) -> None:
    """What a gateway node does when a session ends: DELETE it from our gateway (after the pass, untimed),
    so the gateway holds the sessions a serving gateway holds, not every session of every round."""
    import httpx

    sids, forget = target.pop("sessions_used", set()), target.get("forget")
    if not forget:
        return
    base, token = forget
    gate = asyncio.Semaphore(8)
    async with httpx.AsyncClient(base_url=base, timeout=30, headers={"Authorization": f"Bearer {token}"}) as http:
        async def drop(sid: str) -> None:
            async with gate:
                await http.delete(f"/admin/sessions/{sid}")
        await asyncio.gather(*(drop(sid) for sid in sids))


def pass_tag() -> str:
    """Unique per pass: a session id is never reused across rounds (its state would make a first call a break)."""
    return f"{os.getpid()}-{time.monotonic_ns() % 10**9}"


async def run_load(target: dict, world: dict, clients: int, total: int, max_bytes: int) -> dict:
    """``clients`` concurrent sessions sending ``total`` requests in all; latencies and calls/s."""
    latencies: list[float] = []
    sizes: list[int] = []
    errors: list[str] = []
    remaining = [total]
    tag = pass_tag()

    async with http_client(clients) as http:
        async def client(n: int) -> None:
            session = 0
            conv = Conversation(world, target["provider"], max_bytes)
            while remaining[0] > 0:
                remaining[0] -= 1
                ms, raw, status, size = await send(http, target, f"c{clients}-{n}-{session}-{tag}", conv.body())
                latencies.append(ms)
                sizes.append(size)
                if status != 200:
                    errors.append(f"{status}: {raw[:200]!r}")
                    continue
                if not conv.advance(tool_call_id(raw, target.get("stream", True))):
                    session += 1
                    conv = Conversation(world, target["provider"], max_bytes)

        cpu0 = server_cpu_s(target)
        t0 = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        wall = time.perf_counter() - t0
        cpu = server_cpu_s(target) - cpu0 if cpu0 is not None else None
    return {"clients": clients, "requests": total, "errors": len(errors), "first_error": errors[0] if errors else None,
            "calls_per_s": round(total / wall, 1), "p50_ms": pct(latencies, 0.5), "p99_ms": pct(latencies, 0.99),
            "server_cpu_ms_per_call": round(cpu * 1000 / total, 3) if cpu is not None else None,
            "request_kb": [round(min(sizes) / 1024, 1), round(max(sizes) / 1024, 1)] if sizes else []}


def server_cpu_s(target: dict) -> float | None:
    """CPU seconds (user + system) the target's server process and its children have used so far: the
    process's own counters, so a proxied call's CPU is the change over a load divided by its calls."""
    pid = target.get("pid")
    return None if pid is None else proc_cpu_s([pid, *_children(pid)])


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


EXTEND_FROM, EXTEND_TO = 75_000, 86_000  # bytes: the extend_80kb calls timed


async def extend_80kb(target: dict, world: dict, sessions: int) -> dict:
    """1 client: per session, an untimed ~73 KB first call, then the calls of 75-86 KB that extend it, timed.
    On our gateway, its per-stage metrics are read before a session's first timed call and after its last."""
    latencies, sizes, errors, tag = [], [], [], pass_tag()
    stages = StageMeter(target.get("metrics"))
    async with http_client() as http:
        for s in range(sessions):
            conv = Conversation(world, target["provider"], EXTEND_TO).prefill(EXTEND_FROM)
            while True:
                body = conv.body()
                if len(json.dumps(body)) >= EXTEND_FROM:  # the size send() will report: this call is timed
                    await stages.start(http)
                ms, raw, status, size = await send(http, target, f"x80-{s}-{tag}", body)
                if status != 200:
                    errors.append(f"{status}: {raw[:200]!r}")
                    break
                if size >= EXTEND_FROM:
                    latencies.append(ms)
                    sizes.append(size)
                if not conv.advance(tool_call_id(raw, target.get("stream", True))):
                    break
            await stages.stop(http)
    return {**scenario_result(latencies, sizes, errors), **stages.result()}


class StageMeter:
    """Seconds and calls per stage (``polar_gateway_stage_seconds``, gateway/metrics.py) over the spans
    between ``start`` and ``stop``, from the gateway's /metrics; a no-op for a target without one."""

    def __init__(self, url: str | None):
        self.url, self.sums, self.counts, self._open = url, {}, {}, None

    async def _read(self, http) -> dict[str, tuple[float, float]]:
        from prometheus_client.parser import text_string_to_metric_families

        async with http.get(self.url) as r:
            text = await r.text()
        out: dict[str, list[float]] = {}
        for fam in text_string_to_metric_families(text):
            if fam.name == "polar_gateway_stage_seconds":
                for sample in fam.samples:
                    kind = sample.name.rsplit("_", 1)[1]
                    if kind in ("sum", "count"):
                        out.setdefault(sample.labels["stage"], [0.0, 0.0])[kind == "count"] = sample.value
        return {stage: (v[0], v[1]) for stage, v in out.items()}

    async def start(self, http) -> None:
        if self.url and self._open is None:
            self._open = await self._read(http)

    async def stop(self, http) -> None:
        if self._open is None:
            return
        after, before, self._open = await self._read(http), self._open, None
        for stage, (total, n) in after.items():
            t0, n0 = before.get(stage, (0.0, 0.0))
            self.sums[stage] = self.sums.get(stage, 0.0) + total - t0
            self.counts[stage] = self.counts.get(stage, 0.0) + n - n0

    def result(self) -> dict:
        return {"stage_seconds": self.sums, "stage_calls": self.counts} if self.url else {}


async def fresh_80kb(target: dict, world: dict, sessions: int) -> dict:
    """1 client: one untimed session of the task, then the first ~80 KB call of ``sessions`` new ones, timed."""
    latencies, sizes, errors, tag = [], [], [], pass_tag()
    async with http_client() as http:
        for s in range(sessions + 1):
            body = Conversation(session_task(world, s), target["provider"], EXTEND_TO).body()
            ms, raw, status, size = await send(http, target, f"f80-{s}-{tag}", body)
            if status != 200:
                errors.append(f"{status}: {raw[:200]!r}")
            elif s:  # session 0 only shows the gateway the task's system prompt and tools
                latencies.append(ms)
                sizes.append(size)
    return scenario_result(latencies, sizes, errors)


def scenario_result(latencies: list[float], sizes: list[int], errors: list[str]) -> dict:
    """One pass of a scenario; ``latencies_ms`` are pooled over rounds, then dropped (see pooled())."""
    return {"calls": len(latencies), "latencies_ms": [round(x, 3) for x in latencies], "errors": len(errors),
            "first_error": errors[0] if errors else None,
            "request_kb": [round(min(sizes) / 1024, 1), round(max(sizes) / 1024, 1)] if sizes else []}


# ------------------------------------------------------------------------------------ processes


def start_agl(tmp: Path, stub: str) -> tuple[subprocess.Popen, str]:
    """Agent Lightning's server with the stub registered and one rollout; returns its chat base URL."""
    import httpx

    from infra.process import free_port

    port = free_port()
    proc = spawn([str(PEERS / "agl/bin/agl-server"), "host=127.0.0.1", f"port={port}", "default_proxy.model_name=stub-model",
                  f"hydra.run.dir={tmp / 'agl-hydra'}"], tmp / "agl.log")
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/api/rollouts", proc)
    httpx.post(base + "/api/models", json=[{"model": "stub-model", "endpoint": stub + "/v1", "version": 0}]).raise_for_status()
    httpx.post(base + "/api/rollouts", json=[{"rollout_id": "r1", "input": {}}]).raise_for_status()
    return proc, base + "/proxy/rollout/r1/attempt/{attempt}/mode/train/openai/v1/chat/completions"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests (under a minute with a warm cache)")
    ap.add_argument("--bootstrap", default="", help="use this running Kafka instead of starting one")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every target")
    ap.add_argument("--serve-stub", nargs="+", metavar="PORT SPEC [TOKENIZER]", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_stub:
        return serve_stub(int(args.serve_stub[0]), *args.serve_stub[1:])
    asyncio.run(bench(args))


# A pass is client + servers exchanging requests; under half a core in all it was starved by other jobs.
CPU_FLOOR = 0.5
MEDIANS = ("calls_per_s", "p50_ms", "p99_ms")


SCENARIOS = {"extend_80kb": extend_80kb, "fresh_80kb": fresh_80kb}
VLLM_LIKE = "@vllm_like"  # in a target's name: in front of the stub that tokenizes Chat prompts as vLLM does


def run_plan(target: dict, world: dict, plan: dict[int, int], scenarios: dict[str, tuple[dict, int]]) -> dict:
    """One pass for one target: its whole load plan (1, 16, 64 clients), then its scenarios (name ->
    (world, sessions)) when it takes part in them, in a fresh event loop."""
    async def go() -> dict:
        out: dict = {str(c): await run_load(target, world, c, n, 80_000) for c, n in plan.items()}
        if target.get("scenarios"):
            for name, (scenario_world, sessions) in scenarios.items():
                out[name] = await SCENARIOS[name](target, scenario_world, sessions)
        await forget_sessions(target)
        return out
    try:
        return asyncio.run(go())
    except Exception as e:  # a peer failing must not hide the others' numbers
        return {"failed": f"{type(e).__name__}: {e}"}


def medians(passes: list[dict]) -> dict:
    """Per client count, the median over rounds of calls/s and latencies; errors summed over rounds.
    Scenarios: percentiles over the calls of every round pooled."""
    failed = [p["failed"] for p in passes if "failed" in p]
    if failed:
        return {"failed": failed[0], "failed_passes": len(failed)}
    out = {}
    for c in (k for k in passes[0] if isinstance(passes[0][k], dict)):
        runs = [p[c] for p in passes]
        if c in SCENARIOS:
            out[c] = pooled(runs)
            continue
        out[c] = {"clients": runs[0]["clients"], "requests": runs[0]["requests"], "rounds": len(runs),
                  **{k: round(statistics.median(r[k] for r in runs), 2) for k in MEDIANS},
                  "calls_per_s_min": min(r["calls_per_s"] for r in runs), "calls_per_s_max": max(r["calls_per_s"] for r in runs),
                  "server_cpu_ms_per_call": _median_or_none([r.get("server_cpu_ms_per_call") for r in runs]),
                  "errors": sum(r["errors"] for r in runs), "first_error": next((r["first_error"] for r in runs if r["first_error"]), None),
                  "request_kb": runs[-1]["request_kb"]}
    return out


def _median_or_none(values: list) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return round(statistics.median(values), 3) if values else None


def pooled(runs: list[dict]) -> dict:
    """A scenario's p50/p99 (and mean) over every round's calls; the raw latencies leave the passes (kept
    small). Where the gateway's stages were read, their mean ms per call over every round."""
    latencies = [x for r in runs for x in r.pop("latencies_ms")]
    kb = [k for r in runs for k in r["request_kb"]]
    out = {"calls": len(latencies), "rounds": len(runs), "p50_ms": pct(latencies, 0.5), "p99_ms": pct(latencies, 0.99),
           "mean_ms": round(statistics.fmean(latencies), 3) if latencies else None,
           "errors": sum(r["errors"] for r in runs), "first_error": next((r["first_error"] for r in runs if r["first_error"]), None),
           "request_kb": [min(kb), max(kb)] if kb else []}
    if any("stage_seconds" in r for r in runs):
        stages = list(dict.fromkeys(s for r in runs for s in r.get("stage_calls", {})))  # the gateway's order
        total = {s: sum(r.get("stage_seconds", {}).get(s, 0.0) for r in runs) for s in stages}
        calls = {s: sum(r.get("stage_calls", {}).get(s, 0.0) for r in runs) for s in stages}
        out["stage_mean_ms"] = {s: round(total[s] / calls[s] * 1000, 3) for s in stages if calls[s]}
    return out


def server_pids(procs: list[subprocess.Popen], kafka) -> list[int]:
    """The servers' pids and their children's (the worker processes of ``--processes 2``)."""
    pids = [p.pid for p in procs if p.poll() is None]
    pid = kafka.pid() if kafka is not None else None
    pids += [pid] if pid else []
    return [c for parent in pids for c in (parent, *_children(parent))]


def added(results: dict, target: str, anchor: str, scenario: str, key: str) -> float | None:
    """``target``'s ``key`` latency in ``scenario`` minus ``anchor``'s, or None when either is missing."""
    ours, base = (results.get(t, {}).get(scenario, {}).get(key) for t in (target, anchor))
    return round(ours - base, 2) if isinstance(ours, (int, float)) and isinstance(base, (int, float)) else None


def headline(out: dict, peers: dict) -> dict:
    """The top-level figures of issue 19 (see the module docstring)."""
    def calls_16(name: str) -> float | None:
        return out.get(name, {}).get("16", {}).get("calls_per_s")

    ours, direct, peer = "polarstream.chat_stream", "direct_engine.chat_stream", "rllm-model-gateway.chat_stream"
    figures = {"added_latency_ms_p50": added(out, ours, direct, "extend_80kb", "p50_ms"),
               "added_latency_ms_p99": added(out, ours, direct, "extend_80kb", "p99_ms"),
               "fresh_call_added_ms_p50": added(out, ours, direct, "fresh_80kb", "p50_ms"),
               "calls_per_s_16_clients": calls_16(ours),
               "calls_per_s_16_clients_2_processes": calls_16("polarstream_2proc.chat_stream"),
               "peer_calls_per_s_16_clients": calls_16(peer),
               # Where extend_80kb's added time goes: the mean added ms, and the gateway's mean ms per stage
               # (gateway/metrics.py); the rest of the mean is HTTP, parsing the request and rendering the answer.
               "added_latency_ms_mean": added(out, ours, direct, "extend_80kb", "mean_ms"),
               "added_latency_stages_ms_mean": out.get(ours, {}).get("extend_80kb", {}).get("stage_mean_ms")}
    figures.update(versus_peer(out, ours, peer, direct))
    figures.update(versus_peer_vllm_like(out))
    if figures["peer_calls_per_s_16_clients"] is None:
        figures["peer_calls_per_s_16_clients_reason"] = (out.get(peer, {}).get("failed")
                                                         or peers.get("rllm-model-gateway", "not measured"))
    return figures


def versus_peer(out: dict, ours: str, peer: str, direct: str) -> dict:
    """Issue 47's gateway bars, each ours ÷ the peer's from the same rounds (None where either is missing).

    - calls/s at 16 and 64 clients (bar: >= 1.0);
    - the gateway process's CPU ms per proxied call at 16 clients, from its own counters (bar: <= 1.5);
    - p50 added latency on extend_80kb, ours less the publish stage (the wait for Kafka's acknowledgement,
      which the peer, recording nothing durably, does not pay), over the peer's added p50 (bar: <= 1.5).
    """
    def get(name: str, *keys: str):
        d = out.get(name, {})
        for k in keys:
            d = d.get(k, {}) if isinstance(d, dict) else {}
        return d if isinstance(d, (int, float)) else None

    def ratio(a, b):
        return round(a / b, 3) if a is not None and b else None

    ack = get(ours, "extend_80kb", "stage_mean_ms", "publish")
    ours_added = added(out, ours, direct, "extend_80kb", "p50_ms")
    less_ack = round(ours_added - ack, 2) if ours_added is not None and ack is not None else None
    return {"gateway_calls_per_s_vs_peer_16": ratio(get(ours, "16", "calls_per_s"), get(peer, "16", "calls_per_s")),
            "gateway_calls_per_s_vs_peer_64": ratio(get(ours, "64", "calls_per_s"), get(peer, "64", "calls_per_s")),
            "gateway_cpu_ms_per_call": get(ours, "16", "server_cpu_ms_per_call"),
            "peer_cpu_ms_per_call": get(peer, "16", "server_cpu_ms_per_call"),
            "gateway_cpu_ms_per_call_vs_peer": ratio(get(ours, "16", "server_cpu_ms_per_call"),
                                                     get(peer, "16", "server_cpu_ms_per_call")),
            "gateway_added_p50_less_ack_ms": less_ack, "gateway_publish_ack_ms_mean": ack,
            "peer_added_p50_ms": added(out, peer, direct, "extend_80kb", "p50_ms"),
            "gateway_added_p50_less_ack_vs_peer": ratio(less_ack, added(out, peer, direct, "extend_80kb", "p50_ms"))}


def versus_peer_vllm_like(out: dict) -> dict:
    """The same race in front of the vLLM-like stub, end to end (harness to answer), ours ÷ the peer's.

    The stub above charges a Chat prompt nothing, so the figures against it count our tokenizing as the
    gateway's cost and the engine's re-tokenizing of every forwarded 80 KB prompt as free. In front of an
    engine that does what vLLM does, each system pays for what it makes the engine do."""
    def get(name: str, *keys: str):
        d = out.get(f"{name}{VLLM_LIKE}.chat_stream", {})
        for k in keys:
            d = d.get(k, {}) if isinstance(d, dict) else {}
        return d if isinstance(d, (int, float)) else None

    def ratio(a, b):
        return round(a / b, 3) if a is not None and b else None

    tokenizing = [get("direct_engine", "extend_80kb", "p50_ms"), out.get("direct_engine.chat_stream", {}).get("extend_80kb", {}).get("p50_ms")]
    return {"vllm_like_engine_tokenize_ms_p50_80kb": round(tokenizing[0] - tokenizing[1], 2) if None not in tokenizing else None,
            "vllm_like_gateway_p50_ms_80kb": get("polarstream", "extend_80kb", "p50_ms"),
            "vllm_like_peer_p50_ms_80kb": get("rllm-model-gateway", "extend_80kb", "p50_ms"),
            "vllm_like_gateway_p50_vs_peer_80kb": ratio(get("polarstream", "extend_80kb", "p50_ms"),
                                                        get("rllm-model-gateway", "extend_80kb", "p50_ms")),
            "vllm_like_gateway_calls_per_s_vs_peer_16": ratio(get("polarstream", "16", "calls_per_s"),
                                                              get("rllm-model-gateway", "16", "calls_per_s")),
            "vllm_like_gateway_calls_per_s_vs_peer_64": ratio(get("polarstream", "64", "calls_per_s"),
                                                              get("rllm-model-gateway", "64", "calls_per_s"))}


async def bench(args: argparse.Namespace) -> None:
    from schemas.session_keys import mint_session_key
    from gateway.template import ChatTemplate
    from infra.models import ensure_model
    from infra.process import free_port

    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    procs: list[subprocess.Popen] = []
    kafka = None
    result: dict = {"mode": "quick" if args.quick else "full", "cores": os.cpu_count(), "load_avg_start": os.getloadavg()[0]}
    t_start = time.monotonic()
    try:
        model_dir = ensure_model("tiny")
        tpl = ChatTemplate.load(str(model_dir))
        spec = tmp / "stub.json"
        spec.write_text(json.dumps({"completion_ids": tpl.encode("<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>") + [tpl.eot.token_id]}))
        stub_port = free_port()
        procs.append(spawn([sys.executable, __file__, "--serve-stub", str(stub_port), str(spec)], tmp / "stub.log"))
        stub = f"http://127.0.0.1:{stub_port}"
        wait_http(stub + "/health", procs[-1])
        vllm_port = free_port()  # the vLLM-like stub: it tokenizes Chat prompts, as vLLM does (serve_stub)
        procs.append(spawn([sys.executable, __file__, "--serve-stub", str(vllm_port), str(spec), str(model_dir)], tmp / "stub-vllm.log"))
        vllm_like = f"http://127.0.0.1:{vllm_port}"
        wait_http(vllm_like + "/health", procs[-1])

        # Every call waits for its acknowledgement: the broker runs its full JIT, as a deployed one does.
        settings, kafka = kafka_for_bench(args.bootstrap, tmp, "bench", quick_jit=False)

        gw_port = free_port()
        env = server_env(settings, tmp)
        procs.append(spawn([sys.executable, "-c", "from polarstream.cli import main; main()", "gateway", "--engine-url", stub,
                            "--model", str(model_dir), "--port", str(gw_port)], tmp / "gateway.log", env))
        ours = f"http://127.0.0.1:{gw_port}"
        gw2_port = free_port()  # the same gateway as 2 processes behind the session router
        procs.append(spawn([sys.executable, "-c", "from polarstream.cli import main; main()", "gateway", "--engine-url", stub,
                            "--model", str(model_dir), "--port", str(gw2_port), "--processes", "2"], tmp / "gateway-2proc.log", env))
        ours_2proc = f"http://127.0.0.1:{gw2_port}"
        # Our gateway in front of the vLLM-like stub.
        gw3_port = free_port()
        procs.append(spawn([sys.executable, "-c", "from polarstream.cli import main; main()", "gateway", "--engine-url", vllm_like,
                            "--model", str(model_dir), "--port", str(gw3_port)], tmp / "gateway-vllm-like.log", env))
        ours_vllm_like = f"http://127.0.0.1:{gw3_port}"
        wait_http(ours + "/health", procs[-3])
        wait_http(ours_2proc + "/health", procs[-2])
        wait_http(ours_vllm_like + "/health", procs[-1])
        pids = {ours: procs[-3].pid, ours_2proc: procs[-2].pid, ours_vllm_like: procs[-1].pid}  # 2-process: its workers too
        secret = settings.session_secret

        def ours_target(provider: str, base: str = ours) -> dict:
            path = "/v1/messages" if provider == "anthropic" else "/v1/chat/completions"
            return {"provider": provider, "scenarios": True, "forget": (base, settings.admin_token), "metrics": base + "/metrics",
                    "pid": pids[base], "url": lambda sid: (base + path, {"x-api-key": mint_session_key(sid, secret)})}

        targets: dict[str, dict] = {
            "direct_engine.chat_stream": {"provider": "chat", "scenarios": True,
                                          "url": lambda sid: (stub + "/v1/chat/completions", {})},
            "polarstream.anthropic_stream": ours_target("anthropic"),
            "polarstream.chat_stream": ours_target("chat"),
            # Non-streaming Chat: the mode Agent Lightning is measured in, so it has a like-for-like row.
            "polarstream.chat_json": {**ours_target("chat"), "stream": False, "scenarios": False},
            "polarstream_2proc.chat_stream": ours_target("chat", ours_2proc),
            f"direct_engine{VLLM_LIKE}.chat_stream": {"provider": "chat", "scenarios": True,
                                                      "url": lambda sid: (vllm_like + "/v1/chat/completions", {})},
            f"polarstream{VLLM_LIKE}.chat_stream": ours_target("chat", ours_vllm_like),
        }
        peers: dict[str, str] = {}
        install_peer("rllm", "rllm-model-gateway", "rllm-model-gateway")
        if (PEERS / "rllm/bin/rllm-model-gateway").exists():
            for suffix, engine, log in (("", stub, "rllm.log"), (VLLM_LIKE, vllm_like, "rllm-vllm-like.log")):
                rport = free_port()
                procs.append(spawn([str(PEERS / "rllm/bin/rllm-model-gateway"), "--host", "127.0.0.1", "--port", str(rport),
                                    "--worker", engine + "/v1", "--store", "memory", "--log-level", "warning"], tmp / log))
                wait_http(f"http://127.0.0.1:{rport}/health", procs[-1])
                targets[f"rllm-model-gateway{suffix}.chat_stream"] = {"provider": "chat", "scenarios": True, "pid": procs[-1].pid,
                                                                      "url": lambda sid, p=rport: (
                    f"http://127.0.0.1:{p}/sessions/{sid}/v1/chat/completions", {})}
            peers["rllm-model-gateway"] = "0.1.0 from PyPI (python3.11 venv), --store memory; Chat only (no Anthropic route in 0.1.0)"
        else:
            peers["rllm-model-gateway"] = f"not installed: python3.11 -m venv {PEERS}/rllm && {PEERS}/rllm/bin/pip install rllm-model-gateway"
        if (PEERS / "agl/bin/agl-server").exists():
            proc, agl_url = start_agl(tmp, stub)
            procs.append(proc)
            targets["agentlightning.chat_json"] = {"provider": "chat", "stream": False,
                                                   "url": lambda sid, u=agl_url: (u.format(attempt="a1"), {})}
            peers["agentlightning"] = "1.0.2 (python3.12 venv); streaming is rejected with 400, so non-streaming Chat is measured"
        else:
            peers["agentlightning"] = f"not installed: python3.12 -m venv {PEERS}/agl && {PEERS}/agl/bin/pip install agentlightning"

        world = make_world()
        # Sized so 3 rounds of 7 targets fit the budget in bench/run_all.py (quick 110 s, full 390 s) on a quiet
        # machine; at load average ~10 the quick run took 195 s, 87 of them starting Kafka and the servers.
        plan = {1: 8, 16: 16, 64: 64} if args.quick else {1: 80, 16: 160, 64: 256}
        # extend_80kb: ~4 timed calls a session; fresh_80kb: one a session. Pooled over the rounds.
        scenarios = {"extend_80kb": (world, 3 if args.quick else 12), "fresh_80kb": (make_fresh_world(), 6 if args.quick else 24)}
        result["setup_s"] = round(time.monotonic() - t_start, 1)
        for target in targets.values():  # warm-up (connections, first renders); failures show in the rounds
            try:
                await run_load(target, world, 1, 2, 80_000)
            except Exception:
                pass
        rounds = await asyncio.to_thread(
            interleaved, {name: (lambda t=target: run_plan(t, world, plan, scenarios)) for name, target in targets.items()},
            args.rounds, cpu_floor=CPU_FLOOR, retries=1, progress=False, cpu_pids=lambda: server_pids(procs, kafka))
        out: dict[str, dict] = {name: medians(t["passes"]) for name, t in rounds["targets"].items()}
        result["rounds"] = rounds
        direct = out["direct_engine.chat_stream"].get("1", {})
        for name, runs in out.items():
            if name.startswith("direct") or "1" not in runs or VLLM_LIKE in name:
                continue
            runs["added_latency_ms"] = {"p50": round(runs["1"]["p50_ms"] - direct.get("p50_ms", 0), 2),
                                        "p99": round(runs["1"]["p99_ms"] - direct.get("p99_ms", 0), 2)}
        for name, runs in out.items():
            for scenario in SCENARIOS:
                if scenario in runs and not name.startswith("direct") and VLLM_LIKE not in name:
                    runs[scenario]["added_ms"] = {q: added(out, name, "direct_engine.chat_stream", scenario, f"{q}_ms")
                                                  for q in ("p50", "p99")}
        result.update(headline(out, peers))
        result.update({"upstream": "stdlib vLLM-shaped stub (fixed 30-token tool call; Chat answers carry token ids)",
                       "peers": peers, "results": out, "load_avg_end": os.getloadavg()[0],
                       "total_s": round(time.monotonic() - t_start, 1)})
    finally:
        stop(procs, timeout=15)
        if kafka is not None:
            kafka.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # broker data and logs: nothing left in /tmp between runs
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
