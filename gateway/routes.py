"""The model-API routes: one catch-all that accepts any base-path prefix and a ``/s/{key}`` prefix.

Path (then headers, then body) picks the provider adapter; every answer, error or not, is rendered by
that adapter in its provider's shape. A request flows: session key -> body (size limit, JSON) ->
adapter.parse_request -> Gateway.call -> adapter.render_response / render_stream.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any

import orjson
from fastapi import APIRouter, Request, WebSocket
from fastapi.exception_handlers import http_exception_handler
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse

from schemas.session_keys import InvalidSessionKey, SessionClaims, open_session_claims, verify_session_key

from . import errors
from .canonical import ProviderAdapter, RequestError
from .events import harness_from_user_agent
from .limits import KeyLimiter, Limits, check_body, check_request
from .providers import ADAPTERS, parse_route
from .providers.detection import CHAT, GOOGLE
from .service import Gateway

log = logging.getLogger("polarstream.gateway")
router = APIRouter()


class JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def split_session_prefix(path: str) -> tuple[str, str]:
    """``/gw/s/KEY/v1/messages`` -> (KEY, ``/gw/v1/messages``); no ``/s/`` segment -> ('', path)."""
    parts = path.split("/")
    for i in range(len(parts) - 2):
        if parts[i] == "s" and parts[i + 1]:
            return parts[i + 1], "/".join(parts[:i] + parts[i + 2 :])
    return "", path


def header_key(request: Request) -> str:
    """The API key a harness sent, whichever header (or ``?key=``) its provider uses."""
    h = request.headers
    auth = h.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return h.get("x-api-key") or h.get("x-goog-api-key") or request.query_params.get("key", "")


def authenticate(gw: Gateway, secret: str, path_key: str, request: Request) -> SessionClaims:
    """The session a call belongs to; in closed mode only a key signed with ``secret`` is accepted."""
    key = path_key or header_key(request)
    if key:
        try:
            return verify_session_key(key, secret)
        except InvalidSessionKey as e:
            if not gw.config.open_mode:
                raise errors.unauthorized(f"invalid session key: {e}") from None
    elif not gw.config.open_mode:
        raise errors.unauthorized("missing session key (send it as the API key or a /s/{key} path prefix)")
    # Open mode: a name in the path or x-session-id names the session, under open: (never a rollout's).
    name = "" if path_key.startswith("sk-") else path_key  # an API key in the path is hashed, not shown
    if name := name or request.headers.get("x-session-id", ""):
        return open_session_claims(name=name)
    return open_session_claims(key or "anonymous")


def _decompress(body: bytes, encoding: str) -> bytes:
    if encoding in ("", "identity"):
        return body
    if encoding in ("gzip", "deflate"):
        try:
            return zlib.decompress(body, 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
        except zlib.error as e:
            raise RequestError(400, f"body: cannot decompress {encoding} ({e})") from None
    raise RequestError(415, f"content-encoding {encoding!r} is not supported (send identity, gzip or deflate)")


async def read_json(request: Request, limit: int, limits: Limits | None = None) -> dict[str, Any]:
    """The request body as a JSON object, refusing bodies over ``limit`` bytes before reading them.

    ``limits``: the body must also arrive within ``body_timeout_s`` (a stalled client would otherwise
    hold its connection forever) and nest no deeper than ``max_json_depth``.
    """
    limits = limits or Limits()
    too_large = RequestError(413, f"request body exceeds the gateway's limit of {limit} bytes", "request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_large
    except TimeoutError:
        raise RequestError(408, f"request body not received within {limits.body_timeout_s:g}s", "timeout_error") from None
    raw = _decompress(bytes(body), request.headers.get("content-encoding", "").strip().lower())
    if len(raw) > limit:
        raise too_large
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise RequestError(400, f"body: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise RequestError(400, "body: expected a JSON object")
    check_body(data, limits)
    return data


def error_response(adapter: ProviderAdapter, err: RequestError) -> Response:
    return JSON(adapter.render_error(err), status_code=err.status, headers=err.headers)


# A streamed call still running after KEEPALIVE_AFTER_S gets its 200 and the provider's own keep-alive at
# once and every KEEPALIVE_EVERY_S (adapter.render_keepalive: a ping, a comment, a blank line), so proxies
# and harness timeouts do not cut a long generation; content still goes out only once the call is durably
# recorded. Quicker calls answer in one body, with a real status on error.
KEEPALIVE_AFTER_S = 2.0
KEEPALIVE_EVERY_S = 10.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _streamed(adapter: ProviderAdapter, req: Any, call: Awaitable[Any]) -> Response:
    """The SSE answer of a streaming call: one body if it is done within KEEPALIVE_AFTER_S, else kept alive."""
    task = asyncio.ensure_future(call)
    done, _ = await asyncio.wait({task}, timeout=KEEPALIVE_AFTER_S)
    if done:
        resp = task.result()  # a RequestError here is still answered with its own status
        # The whole answer exists already: render it now so a render bug is a clean error, not a cut stream.
        return Response(b"".join(adapter.render_stream(req, resp)), media_type="text/event-stream", headers=SSE_HEADERS)
    task.add_done_callback(_consume)  # the call goes on (and is recorded) even if the client leaves
    return StreamingResponse(_kept_alive(adapter, req, task), media_type="text/event-stream", headers=SSE_HEADERS)


async def _kept_alive(adapter: ProviderAdapter, req: Any, task: asyncio.Future) -> AsyncIterator[bytes]:
    keepalive = adapter.render_keepalive()
    yield keepalive  # sends the 200 and its headers now
    while not task.done():
        await asyncio.wait({task}, timeout=KEEPALIVE_EVERY_S)
        if not task.done():
            yield keepalive
    try:
        yield b"".join(adapter.render_stream(req, task.result()))
    except RequestError as e:  # past the 200: the error goes out in the provider's streamed error shape
        yield adapter.render_stream_error(e)
    except Exception:
        log.exception("unexpected error on a kept-alive stream")
        yield adapter.render_stream_error(RequestError(500, "internal gateway error (see the gateway log)", "api_error"))


def _consume(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a client that left must not leave "exception never retrieved" noise


def _json_array(parts: Iterable[bytes]) -> bytes:
    """``streamGenerateContent`` without ``alt=sse``: Google answers the chunks as one JSON array."""
    chunks = [orjson.loads(line[6:]) for p in parts for line in p.split(b"\n") if line.startswith(b"data: ")]
    return orjson.dumps(chunks)


@router.post("/{path:path}")
async def model_call(request: Request, path: str) -> Response:
    """Any provider's generate or count-tokens call, under any base prefix."""
    gw: Gateway = request.app.state.gateway
    path_key, rest = split_session_prefix("/" + path)
    route = parse_route(rest, request.headers)  # provider for error shapes before the body is read
    adapter = ADAPTERS.get(route.provider, ADAPTERS[CHAT])
    try:
        claims = authenticate(gw, request.app.state.settings.session_secret, path_key, request)
        limits = gw.config.limits
        body = await read_json(request, gw.config.max_body_bytes, limits)
        route = parse_route(rest, request.headers, body)
        adapter = ADAPTERS[route.provider]
        if route.action == "count_tokens":
            counted = adapter.parse_count_tokens(body, model=route.model)
            check_request(counted, limits)
            return JSON(adapter.render_count_tokens(await gw.count_tokens(counted)))
        req = adapter.parse_request(body, model=route.model, stream=route.stream)
        check_request(req, limits)
        harness = claims.harness or harness_from_user_agent(request.headers.get("user-agent", ""))
        limiter, key = key_limiter(request), path_key or header_key(request) or claims.session_id

        async def call() -> Any:
            with limiter.hold(key, claims.session_id):
                return await gw.call(claims, req, harness)

        if req.stream and route.provider == GOOGLE and request.query_params.get("alt") != "sse":
            return Response(_json_array(adapter.render_stream(req, await call())), media_type="application/json")
        if req.stream:
            return await _streamed(adapter, req, call())
        return JSON(adapter.render_response(req, await call()))
    except RequestError as e:
        return error_response(adapter, e)
    except ClientDisconnect:  # the client went away mid-body: nobody to answer, nothing was recorded
        log.info("client disconnected while sending %s", rest)
        return Response(status_code=400)
    except Exception:  # never a stack trace to the harness; the log has it
        log.exception("unexpected error on %s", rest)
        return error_response(adapter, RequestError(500, "internal gateway error (see the gateway log)", "api_error"))


def key_limiter(request: Request) -> KeyLimiter:
    """The app's per-key limiter, made on first use (apps built without ``create_app`` get one too)."""
    state = request.app.state
    if getattr(state, "key_limiter", None) is None:
        state.key_limiter = KeyLimiter(state.gateway.config.limits)
    return state.key_limiter


def _models_body(gw: Gateway, request: Request, rest: str) -> dict[str, Any]:
    name = gw.served_model
    if "/v1beta/" in rest + "/" or request.headers.get("x-goog-api-key"):
        return {"models": [{"name": f"models/{name}", "displayName": name, "inputTokenLimit": gw.max_model_len or 0,
                            "supportedGenerationMethods": ["generateContent", "streamGenerateContent", "countTokens"]}]}
    if request.headers.get("anthropic-version"):
        return {"data": [{"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"}],
                "has_more": False, "first_id": name, "last_id": name}
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "polarstream",
                                        "max_model_len": gw.max_model_len}]}


@router.get("/{path:path}")
async def get_route(request: Request, path: str) -> Response:
    """``/health``, model lists, and a clean 426 for Responses WebSocket attempts (Codex falls back)."""
    gw: Gateway = request.app.state.gateway
    _, rest = split_session_prefix("/" + path)
    rest = rest.rstrip("/")
    if rest.endswith("/health") or rest == "/health":
        return JSON(health(gw))
    if rest.endswith("/models"):
        return JSON(_models_body(gw, request, rest))
    if rest.endswith("/responses"):
        adapter = ADAPTERS[parse_route(rest).provider]
        if request.headers.get("upgrade", "").lower() == "websocket":
            return error_response(adapter, _ws_refusal())
        return error_response(adapter, RequestError(405, "use POST for /responses", "invalid_request_error"))
    return error_response(ADAPTERS[CHAT], RequestError(404, f"no route GET {rest or '/'}", "not_found_error"))


async def routing_error(request: Request, exc: HTTPException) -> Response:
    """A 404/405 from routing itself, in the caller's provider shape (the admin API keeps FastAPI's).

    The catch-all's ``{path:path}`` cannot match a path with a newline (``%0A`` in a Gemini model name:
    found by schemathesis), and other methods than GET/POST/HEAD match no route at all.
    """
    if request.scope["path"].startswith("/admin/"):
        return await http_exception_handler(request, exc)
    _, rest = split_session_prefix(request.scope["path"])
    message = f"no route {request.method} {rest!r}" if exc.status_code == 404 else str(exc.detail)
    err = RequestError(exc.status_code, message, errors.kind_for_status(exc.status_code), headers=dict(exc.headers or {}))
    return error_response(ADAPTERS[parse_route(rest, request.headers).provider], err)


@router.head("/{path:path}")
async def head_route(path: str) -> Response:
    """Claude Code warms its connection with ``HEAD {base}``."""
    return Response(status_code=200)


def _ws_refusal() -> RequestError:
    return RequestError(426, "Responses WebSocket transport is not supported; use HTTP POST", "invalid_request_error",
                        headers={"Connection": "close"})


@router.websocket("/{path:path}")
async def websocket_route(websocket: WebSocket, path: str) -> None:
    """Refuse every WebSocket upgrade with HTTP 426 at once, so Codex switches to HTTP for the turn."""
    err = _ws_refusal()
    body = ADAPTERS[parse_route("/" + path).provider].render_error(err)
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(JSON(body, status_code=426))
    else:  # the server cannot send a denial body: a plain close is still an immediate refusal (403)
        await websocket.close()


def health(gw: Gateway) -> dict[str, Any]:
    """Liveness and a few gauges."""
    return {
        "status": "ok",
        "served_model": gw.served_model,
        "upstream": gw.config.upstream,
        "policy_version": gw.policy_version,
        "paused": gw.gate.paused,
        "in_flight": gw.gate.in_flight,
        "sessions": len(gw.sessions),
        "event_log_stalled": gw.kafka_stalled,
        **gw.counters,
    }
