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

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from infra.settings import Settings

from .protocol import ChatRequest, CompletionRequest, EngineError, parse
from .serving import Engine
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


def create_app(engine: Engine, settings: Settings | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``."""
    settings = settings or Settings()
    weights_lock = asyncio.Lock()  # one weight update at a time

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="polarstream engine", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, e: EngineError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

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
        """The served model names (aliases), as vLLM lists them."""
        return {"object": "list", "data": [
            {"id": n, "object": "model", "created": engine.created, "owned_by": "polarstream", "root": engine.lm.path,
             "parent": None, "max_model_len": engine.max_model_len, "permission": [],
            # Ours only (vLLM does not report it): which logprobs it returns, so a gateway can check.
            "logprobs_mode": engine.options.logprobs_mode} for n in engine.names]}

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
    async def pause(mode: str = "wait", timeout: float | None = None) -> dict[str, Any]:
        """Hold new requests; mode ``wait`` drains running ones, ``abort`` ends them, ``keep`` freezes them."""
        if mode not in ("wait", "abort", "keep"):
            raise EngineError(400, f"mode must be wait, abort or keep, got {mode!r}", "mode")
        try:
            await asyncio.to_thread(engine.batcher.pause, mode, timeout)
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

    @app.post("/update_weights")
    async def update_weights(request: Request) -> dict[str, Any]:
        """Load weights from ``checkpoint_url`` and serve them as ``version``.

        The checkpoint is read while requests keep running; then new requests are held, running ones
        drain, the weights are copied in, and serving resumes (unless it was paused before).
        """
        body = await _json(request)
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
            was_paused = engine.batcher.paused
            await asyncio.to_thread(engine.batcher.pause, "wait")
            try:
                await asyncio.to_thread(engine.batcher.swap_weights, lambda m: apply_state(m, state), version)
            finally:
                if not was_paused:
                    engine.batcher.resume()
        log.info("serving policy version %d from %s", version, req.checkpoint_url)
        return {"status": "ok", "policy_version": version, "tensors": len(state), "seconds": round(time.monotonic() - t0, 3)}

    return app
