"""``create_app(settings, config)``: the gateway as an ASGI app.

The engine client and the Kafka publisher are created in the lifespan (they belong to the serving event
loop); the tokenizer/template is loaded when the app is built, so a bad model path fails at once.
``app.state.gateway`` is the ``Gateway`` (sessions, pause gate, policy version) for in-process callers.
``GET /metrics`` serves the process's Prometheus metrics (gateway/metrics.py; a node's too).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException

from infra import metrics as prometheus
from infra.settings import DEV_ADMIN_TOKEN, DEV_SESSION_SECRET, Settings

from . import admin, metrics, routes
from .config import GatewayConfig
from .openapi import openapi_document
from .probe import LogprobsModeMismatch, TokenizerMismatch, check_logprobs_mode, check_tokenizer
from .redact import redaction_key
from .service import Gateway, Publisher
from .template import ChatTemplate
from .upstream import Upstream, make_upstream

log = logging.getLogger("polarstream.gateway")


class _DenialNoise(logging.Filter):
    """uvicorn logs a refused WebSocket (our 426 denial response) as an ERROR; it is the intended answer."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "returned without completing handshake" not in record.getMessage()


_uvicorn_log = logging.getLogger("uvicorn.error")
if not any(isinstance(f, _DenialNoise) for f in _uvicorn_log.filters):
    _uvicorn_log.addFilter(_DenialNoise())


def _default_publisher(settings: Settings) -> Publisher:
    from producers.publisher import Publisher as KafkaPublisher

    # No linger: every call waits for its own acknowledgement, so batching delay is pure added latency
    # (under load librdkafka still batches what queues up while a request is in flight).
    return KafkaPublisher(settings, linger_ms=0, client_id="polarstream-gateway")


def load_template(config: GatewayConfig) -> ChatTemplate:
    """The served model's tokenizer and chat template, as the config names them."""
    return ChatTemplate.load(config.model, chat_template=config.chat_template, template_kwargs=config.template_kwargs)


def create_app(
    settings: Settings,
    config: GatewayConfig,
    *,
    template: ChatTemplate | None = None,
    publisher_factory: Callable[[Settings], Publisher] = _default_publisher,
    upstream_factory: Callable[[GatewayConfig], Upstream] | None = None,
) -> FastAPI:
    """The gateway app. ``template`` may be shared between apps (tests); the factories build the
    Kafka publisher and engine client inside the lifespan."""
    if template is None:
        template = load_template(config)
    gw = Gateway(config, template)
    gw.redactor.key = redaction_key(settings.session_secret).encode()  # stable per deployment, not guessable
    gw.topic_prefix = settings.topic_prefix
    # another run sharing this gateway: its calls go to its own topics (service.py, "Runs")
    gw.publisher_for_prefix = lambda prefix: publisher_factory(settings.model_copy(update={"topic_prefix": prefix}))
    if settings.admin_token == DEV_ADMIN_TOKEN or settings.session_secret == DEV_SESSION_SECRET:
        log.warning("gateway runs with the development admin token / session secret: set POLAR_ADMIN_TOKEN and "
                    "POLAR_SESSION_SECRET before exposing it")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gw.upstream = upstream_factory(config) if upstream_factory else make_upstream(
            config.upstream, config.engine_urls, served_model=config.served_model, timeout_s=config.upstream_timeout_s,
            connect_timeout_s=config.connect_timeout_s)
        await _discover_model(gw)
        try:
            verdict = await check_tokenizer(getattr(template, "tokenizer", None), gw.upstream, gw.served_model,
                                            config.model)
        except TokenizerMismatch as e:
            log.error("refusing to start: %s", e)
            await gw.upstream.aclose()
            raise
        if verdict:
            log.warning("tokenizer %s", verdict)
        gw.publisher = publisher_factory(settings)
        try:
            yield
        finally:
            await gw.upstream.aclose()
            await _close(gw.publisher)
            for p in gw.run_publishers.values():
                await _close(p)

    app = FastAPI(title="polarstream gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gw
    app.state.settings = settings
    app.include_router(admin.router)  # before the catch-all model routes
    prometheus.mount(app)  # GET /metrics (docs/operations.md), also before the catch-all
    metrics.watch(gw)
    document = openapi_document(config.limits, config.max_body_bytes)  # hand-written: the routes are one catch-all
    app.add_api_route("/openapi.json", lambda: routes.JSON(document), methods=["GET"], include_in_schema=False)
    app.include_router(routes.router)
    app.add_exception_handler(HTTPException, routes.routing_error)  # type: ignore[arg-type]
    return app


async def _discover_model(gw: Gateway) -> None:
    """Fill the served model name and context length from the engine when not configured, and refuse
    an engine whose reported logprobs are not of the distribution the run samples from."""
    assert gw.upstream is not None
    info = await gw.upstream.model_info()
    try:
        check_logprobs_mode(info.logprobs_mode, gw.config.sampling)
    except LogprobsModeMismatch as e:
        log.error("refusing to start: %s", e)
        await gw.upstream.aclose()
        raise
    if not gw.config.served_model:
        if info.id:
            gw.served_model = info.id
        else:
            log.warning("engine did not list its model; sending model=%r upstream", gw.served_model)
        if hasattr(gw.upstream, "served_model"):
            gw.upstream.served_model = gw.served_model  # type: ignore[attr-defined]
    if gw.max_model_len is None:
        gw.max_model_len = info.max_model_len


async def _close(publisher: Any) -> None:
    close = getattr(publisher, "aclose", None) or getattr(publisher, "close", None)
    if close is None:
        return
    result = close()
    if hasattr(result, "__await__"):
        await result
