"""A tiny FastAPI app that wires the adapters to a fixed answer, served on a real socket for the SDKs.

The app is only a socket: it detects the provider, parses with the adapter, records the parsed
request, and renders ``state.response`` (or ``state.error``) with the same adapter. What the tests
check is that the official SDKs accept every byte the adapters produce.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from dataclasses import dataclass, field

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.canonical import ChatRequest, ChatResponse, RequestError
from gateway.providers import ADAPTERS, parse_route

from .helpers import tool_response


@dataclass
class Scenario:
    """What the app answers next; reset before every test."""

    response: ChatResponse = field(default_factory=tool_response)
    error: RequestError | None = None  # answered as an HTTP error in the provider's shape
    stream_error: RequestError | None = None  # answered as a 200 SSE stream holding only the error event
    chunk_chars: int = 7  # small deltas, so the SDKs really accumulate
    count: int = 0
    requests: list[ChatRequest] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)


def make_app(state: Scenario) -> FastAPI:
    app = FastAPI()

    @app.post("/{path:path}")
    async def handle(path: str, request: Request) -> Response:
        body = await request.json()
        route = parse_route("/" + path, request.headers, body)
        adapter = dataclasses.replace(ADAPTERS[route.provider], chunk_chars=state.chunk_chars)
        state.paths.append(request.url.path)
        try:
            if route.action == "count_tokens":
                adapter.parse_count_tokens(body, model=route.model)
                return JSONResponse(adapter.render_count_tokens(state.count))
            req = adapter.parse_request(body, model=route.model, stream=route.stream)
            state.requests.append(req)
            if state.error:
                raise state.error
        except RequestError as err:
            return JSONResponse(adapter.render_error(err), status_code=err.status, headers=err.headers)
        if req.stream and state.stream_error:
            return StreamingResponse(iter([adapter.render_stream_error(state.stream_error)]), media_type="text/event-stream")
        if req.stream:
            return StreamingResponse(adapter.render_stream(req, state.response), media_type="text/event-stream")
        return JSONResponse(adapter.render_response(req, state.response))

    return app


@dataclass
class Server:
    url: str
    state: Scenario


@pytest.fixture(scope="session")
def _server():
    state = Scenario()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # a free port, never a fixed one
    server = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield Server(f"http://127.0.0.1:{sock.getsockname()[1]}", state)
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def server(_server: Server) -> Server:
    """The running app with a fresh scenario (the default answer: reasoning, text and two tool calls)."""
    fresh = Scenario()
    for f in dataclasses.fields(Scenario):
        setattr(_server.state, f.name, getattr(fresh, f.name))
    return _server
