"""The engine's HTTP surface: vLLM's OpenAI-compatible routes plus pause/resume and weight updates.

``create_app(engine, settings)`` builds the FastAPI app; the lifespan starts and stops the engine's
batching thread. Every response carries the ``x-policy-version`` header; generation responses carry
the version that generated them (also as the ``policy_version`` body field).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from infra.settings import Settings

from .lora import AdapterError, adapter_from_tensors, is_lora_key
from .protocol import (ChatRequest, CompletionRequest, EngineError, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest,
                       parse)
from .serving import Engine
from .transfer import (InitInfo, Receiver, TransferError, UpdateInfo, compare_checksums, default_timeout_s, install,
                       is_broadcast_update, model_checksums, parse_info,
                       zero_weights)
from .weights import WeightsError, apply_state, check_state, read_checkpoint

log = logging.getLogger("polarstream.engine")
POLICY_HEADER = "x-policy-version"


class UpdateWeights(BaseModel):
    model_config = ConfigDict(extra="forbid")
    checkpoint_url: str
    version: int | None = None  # None: current + 1


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError as e:
        raise EngineError(400, f"request body is not valid JSON: {e}") from None


GRACE_S = 5.0  # uvicorn's graceful-shutdown bound: beyond it, tasks still running are cancelled


def make_server(app: FastAPI, **config) -> Any:
    """A uvicorn server for ``app`` that, once told to stop (SIGTERM), first ends what the engine holds: queued
    requests get a 503 and running ones end with ``finish_reason="abort"``. Without it a paused engine (or a
    ``keep`` pause's frozen requests) never finished its requests, so uvicorn waited on them for ever."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            app.state.engine.batcher.shut(EngineError(503, "the engine is shutting down"))
            await super().shutdown(sockets)

    config.setdefault("timeout_graceful_shutdown", GRACE_S)
    return _Server(uvicorn.Config(app, **config))


def create_app(engine: Engine, settings: Settings | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``."""
    settings = settings or Settings()
    weights_lock = asyncio.Lock()  # one weight update at a time
    receiver = Receiver(engine.lm.model)  # in-memory weight transfer (engine/transfer.py)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="polarstream engine", lifespan=lifespan)
    app.state.engine = engine
    app.state.receiver = receiver

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, e: EngineError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(TransferError)
    async def _transfer_error(request: Request, e: TransferError) -> JSONResponse:
        return JSONResponse(EngineError(e.status, str(e)).body(), status_code=e.status)

    @app.middleware("http")
    async def _policy_header(request: Request, call_next):
        response = await call_next(request)
        response.headers.setdefault(POLICY_HEADER, str(engine.policy_version))
        return response

    def generated(body: dict[str, Any], version: int) -> JSONResponse:
        return JSONResponse(body, headers={POLICY_HEADER: str(version)})

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        """Text completion from a text or token-id prompt (vLLM layout, ``return_token_ids``)."""
        req = parse(CompletionRequest, await _json(request))
        return generated(*await engine.completions(req, request.headers.get("x-request-id")))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        """Chat completion rendered with the model's chat template; Hermes tool calls parsed."""
        req = parse(ChatRequest, await _json(request))
        return generated(*await engine.chat(req, request.headers.get("x-request-id")))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The served model names (aliases), then the loaded LoRA adapters, as vLLM lists them."""
        return {"object": "list", "data": engine.model_cards()}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        """vLLM's runtime adapter API: ``{lora_name, lora_path}`` (a local directory or an fsspec URL in
        PEFT's layout); requests then select it by ``model``. Answers vLLM's plain-text success line."""
        req = parse(LoadLoRAAdapterRequest, await _json(request))
        return Response(await engine.load_adapter(req, settings), media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        """Remove an adapter by name; requests already running with it finish with it (engine/lora.py)."""
        req = parse(UnloadLoRAAdapterRequest, await _json(request))
        return Response(await engine.unload_adapter(req), media_type="text/plain")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        """Ours only: the batcher's counters (prefills, decode steps, busy_s: seconds with generation in
        flight), for benchmarks that measure how idle the engine is."""
        return dict(engine.batcher.stats)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """Token ids of a text prompt or of a chat rendered with the template."""
        req = parse(TokenizeRequest, await _json(request))
        engine.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise EngineError(400, "give exactly one of 'prompt' or 'messages'")
        if req.messages is not None:
            chat = parse(ChatRequest, {"messages": req.messages, "tools": req.tools,
                                       "add_generation_prompt": req.add_generation_prompt})
            ids = engine.encode_text(engine.render_chat(chat), bool(req.add_special_tokens))
        else:
            ids = engine.encode_text(req.prompt, req.add_special_tokens is not False)
        strs = engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = parse(DetokenizeRequest, await _json(request))
        engine.check_model(req.model)
        if req.tokens:
            engine.check_ids(req.tokens)
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    # ---------------------------------------------------------------- RL control

    @app.post("/pause")
    async def pause(mode: str = "abort", timeout: float | None = None) -> dict[str, Any]:
        """vLLM's ``/pause``: ``abort`` (its default) ends running requests, ``wait`` drains them; in both new
        requests are answered 503 until ``/resume``. ``keep`` freezes running requests and queues new ones."""
        if mode not in ("wait", "abort", "keep"):
            raise EngineError(400, f"mode must be wait, abort or keep, got {mode!r}", "query.mode", type="Bad Request")
        try:
            await asyncio.to_thread(engine.batcher.pause, mode, timeout, True)
        except TimeoutError as e:
            raise EngineError(503, str(e)) from None
        return {"status": "paused"}

    @app.post("/resume")
    async def resume() -> dict[str, Any]:
        engine.batcher.resume()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused() -> dict[str, Any]:
        return {"is_paused": engine.batcher.paused}

    @app.get("/policy_version")
    async def policy_version() -> dict[str, Any]:
        return {"model": engine.names[0], "policy_version": engine.policy_version}

    async def swap_in(apply, version: int) -> float:
        """Put new weights in between two batches and serve them as ``version``; returns the seconds new
        requests were held. The pause the engine was given holds (``wait``, ``abort``, or ``keep``: frozen
        requests go on with the new weights); an engine not paused drains for the swap (a response is never
        generated by two versions) and resumes after it. Both weight routes swap through here."""
        was_paused = engine.batcher.paused
        t0 = time.monotonic()
        if not was_paused:
            await asyncio.to_thread(engine.batcher.pause, "wait")
        try:
            await asyncio.to_thread(engine.batcher.swap_weights, apply, version)
        finally:
            if not was_paused:
                engine.batcher.resume()
        return round(time.monotonic() - t0, 4)

    @app.post("/update_weights")
    async def update_weights(request: Request) -> dict[str, Any]:
        """Load weights from ``checkpoint_url`` and serve them as ``version``.

        The checkpoint is read while requests keep running; then the weights are swapped in (``swap_in``).
        """
        body = await _json(request)
        if is_broadcast_update(body):  # vLLM's weight-transfer protocol: tensors by broadcast, not a URL
            return await receive_weights(body["update_info"])
        if isinstance(body, dict) and isinstance(body.get("update_info"), dict):  # vLLM's RL route wraps it
            body = body["update_info"]
        req = parse(UpdateWeights, body)
        t0 = time.monotonic()
        async with weights_lock:
            version = engine.policy_version + 1 if req.version is None else req.version
            try:
                state = await asyncio.to_thread(read_checkpoint, req.checkpoint_url, settings)
                check_state(engine.lm.model, state)
            except (WeightsError, ValueError, OSError) as e:
                raise EngineError(400, f"cannot load weights: {e}", "checkpoint_url") from None
            pause_s = await swap_in(lambda m: apply_state(m, state), version)
        log.info("serving policy version %d from %s", version, req.checkpoint_url)
        return {"status": "ok", "policy_version": version, "tensors": len(state), "pause_s": pause_s,
                "seconds": round(time.monotonic() - t0, 3)}

    # ---------------------------------------------------------------- in-memory weight transfer
    # vLLM's RLHF dev routes (vllm/entrypoints/serve/dev/rlhf/api_router.py), gloo backend: engine/transfer.py.
    # Every blocking step runs in a thread under an asyncio deadline; on a deadline the receiver aborts
    # (staging dropped, group destroyed), which also ends the thread's collective.

    async def bounded(fn, deadline_s: float, what: str, group=None):
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn), deadline_s)
        except TimeoutError:  # ``group``: a receive aborts the group it ran in, not one formed since
            receiver.abort(f"{what}: no answer within {deadline_s:.1f} s", group)
            raise TransferError(504, f"{what}: deadline of {deadline_s:.1f} s passed; the transfer was aborted "
                                     f"and the engine serves policy version {engine.policy_version}") from None

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> dict[str, Any]:
        """Join the trainer's weight-transfer group: ``{"init_info": {master_address, master_port,
        rank_offset, world_size}}`` (the rendezvous waits for every rank, up to the transfer deadline)."""
        body = await _json(request)
        if not isinstance(body, dict) or body.get("init_info") is None:
            raise EngineError(400, "Missing 'init_info' in request body", "init_info")
        info = parse_info(InitInfo, body["init_info"])
        timeout_s = default_timeout_s()
        out = await bounded(lambda: receiver.init(info, timeout_s), timeout_s + 5, "init_weight_transfer_engine")
        return {"message": "Weight transfer initialized", **out}

    @app.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine() -> dict[str, Any]:
        """Leave the trainer's group (a transfer in progress is dropped; the served weights stay)."""
        receiver.leave()
        return {"message": "Weight transfer shut down"}

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = True) -> dict[str, Any]:
        """vLLM's TP*PP(*DP): one process serves the whole model here."""
        return {"world_size": 1}

    @app.post("/start_weight_update")
    async def start_weight_update() -> dict[str, Any]:
        receiver.start()
        return {"message": "Weight update started"}

    async def receive_weights(raw: Any) -> dict[str, Any]:
        if isinstance(raw, list):  # vLLM: one update_info per worker rank across DP replicas; this engine is one
            if len(raw) != 1:
                raise TransferError(400, f"update_info is a list of {len(raw)}; this engine is one worker (world size 1)")
            raw = raw[0]
        info = parse_info(UpdateInfo, raw)
        g = receiver._group
        per = g.timeout_s if g else default_timeout_s()
        shown = info if info.names or g is None or g.last is None else g.last
        packed = g is not None and g.wire.packed
        n = max(1, -(-sum(shown.nbytes()) // g.wire.packed_buffer_size_bytes)) if packed else len(shown.names)
        out = await bounded(lambda: receiver.receive(info), per * (n + 1) + 5, "update_weights", g)
        return {"message": "Weights updated", **out}

    @app.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> dict[str, Any]:
        """Swap the staged tensors in between two batches and serve them as ``weight_version`` (an integer
        string; none or another string: current + 1). A paused engine stays paused (its /pause mode holds)."""
        body = await _json(request) if await request.body() else {}
        raw = body.get("weight_version") if isinstance(body, dict) else None
        t0 = time.monotonic()
        if isinstance(body, dict) and body.get("lora_name"):
            return await finish_adapter(body, t0)
        async with weights_lock:
            staged, bufs = receiver.take_staged()
            if any(is_lora_key(n) for n in staged):
                raise EngineError(400, "the staged tensors are a LoRA adapter's: finish with 'lora_name' and "
                                       "'lora_config'; the update is dropped", "lora_name")
            try:
                version = int(raw) if raw is not None else engine.policy_version + 1
            except (TypeError, ValueError):
                version = engine.policy_version + 1
            pause_s = await swap_in(lambda m: install(m, staged), version)
            receiver.installed(set(staged), bufs)
        receiver.stats["last_pause_s"] = pause_s
        receiver.stats["last_update_s"] = time.time()
        log.info("serving policy version %d from a weight transfer (%d tensors)", version, len(staged))
        return {"message": "Weight update finished", "policy_version": version, "tensors": len(staged),
                "pause_s": pause_s, "seconds": round(time.monotonic() - t0, 4)}

    async def finish_adapter(body: dict[str, Any], t0: float) -> dict[str, Any]:
        """Ours (vLLM serves adapters from a path only): ``{"lora_name", "lora_config"}`` beside the version makes
        the staged tensors (PEFT keys) the adapter ``lora_name``, loaded as ``/v1/load_lora_adapter`` loads one
        (in place of one of that name); the base weights and their version are untouched, nothing pauses."""
        name = body["lora_name"]
        if not isinstance(name, str):
            raise EngineError(400, f"lora_name must be a string, got {type(name).__name__}", "lora_name")
        async with weights_lock:
            staged, _ = receiver.take_staged()  # the adapter's tensors are views of these buffers: not recycled
        session = receiver.describe()["session"]
        try:
            adapter = await asyncio.to_thread(adapter_from_tensors, name, f"weight-transfer:{session}",
                                              body.get("lora_config"), staged, engine.lm.model)
        except AdapterError as e:
            raise EngineError(400, f"cannot serve the transferred adapter {name!r}: {e}", "lora_config") from None
        await engine.install_adapter(adapter)
        log.info("serving LoRA adapter %r from a weight transfer (%d tensors)", name, len(staged))
        return {"message": "Weight update finished", "lora_name": name, "policy_version": engine.policy_version,
                "tensors": len(staged), "pause_s": 0.0, "seconds": round(time.monotonic() - t0, 4)}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict[str, Any]:
        body = await _json(request)
        new = body.get("new_version") if isinstance(body, dict) else None
        try:
            engine.batcher.policy_version = int(new)
        except (TypeError, ValueError):
            raise EngineError(400, f"new_version must be an integer string here, got {new!r}", "new_version") from None
        return {"success": True, "new_version": str(new)}

    @app.get("/weight_info")
    async def weight_info() -> dict[str, Any]:
        """vLLM's ``{"weight_version"}``, plus ours: the integer version and the transfer state."""
        return {"weight_version": str(engine.policy_version), "policy_version": engine.policy_version,
                "transfer": receiver.describe()}

    @app.post("/weight_checker")
    async def weight_checker(request: Request) -> JSONResponse:
        """vLLM's: ``{"action": "checksum"}`` -> ``{"checksums": {"dp0:pp0:pcp0:tp0:<name>": sha256}}``;
        ``{"action": "compare", "baseline": {...}}`` -> ``{"match", "mismatches"}`` over the names of both sides (a
        name on one side only is a mismatch); ``{"action": "reset"}`` zeroes the served weights (to test a transfer)."""
        body = await _json(request)
        action = body.get("action") if isinstance(body, dict) else None
        if action not in ("checksum", "reset", "compare"):
            raise EngineError(400, f"action must be one of checksum|reset|compare, got {action!r}", "body.action",
                              type="Bad Request")  # as vLLM's request validation answers
        baseline = body.get("baseline")
        if action == "compare" and baseline is None:
            raise EngineError(400, "action='compare' requires a 'baseline' object", type="Bad Request")
        if baseline is not None and not (isinstance(baseline, dict)
                                         and all(isinstance(v, str) for v in baseline.values())):
            raise EngineError(400, "baseline must be an object of name -> sha256 strings", "body.baseline",
                              type="Bad Request")
        async with weights_lock:
            if action == "reset":
                await asyncio.to_thread(engine.batcher.swap_weights, zero_weights, engine.policy_version)
                return JSONResponse({"status": "reset"})
            sums = await asyncio.to_thread(model_checksums, engine.lm.model)
        if action == "checksum":
            return JSONResponse({"checksums": sums})
        match, mismatches = compare_checksums(baseline, sums)
        return JSONResponse({"match": match, "mismatches": mismatches})

    return app
