"""The session router of ``polarstream gateway --processes N``: one public port, N gateway processes.

A session's state (its chain tip, call index, scrubbed history) lives in the process that served its
previous call, so every call of a session must reach the same process: ``uvicorn --workers`` would
split chains. The router parses each request's head, finds its session exactly as the gateway does
(``routes.split_session_prefix`` and ``routes.authenticate``: ``/s/{key}`` prefix, ``x-api-key``,
``Authorization: Bearer``, ``x-goog-api-key``, ``?key=``, ``x-session-id`` in open mode) and forwards
it to worker ``crc32(session_id) % N`` over a kept-alive unix-socket connection. A request with no
usable key goes to worker 0, which answers the provider-shaped 401 itself. Routing is per request:
one client connection may carry calls of many sessions one after another.

Admin routes (gateway/admin.py) and the process-wide GETs:

- ``POST /admin/pause``, ``/admin/resume``, ``/admin/policy_version`` are writes to per-process state:
  sent to every worker at once, answered when all answered. ``GET /admin/status``,
  ``GET /admin/policy_version``, ``GET /admin/adapters`` and ``GET /health`` read every worker too. Their
  JSON is merged (``merge_json``): numbers summed (in flight, sessions, counters; per name in a dict of
  numbers, as LoRA adapters in flight), ``policy_version`` taken from
  worker 0 (the fan-out writes keep them equal), ``paused``/``drained``/``status`` true or ``ok``
  only if so on every worker, and ``workers`` lists each worker's own answer. A worker that answers
  other than 200 (a bad admin token: all do) has its answer returned as is. A worker that does not
  answer makes ``/health`` a 503.
- ``GET``/``DELETE /admin/sessions/{id}`` reach the worker that owns the session;
  ``POST /admin/sessions`` (minting a key needs only the shared secret) and anything else go to worker 0.
- ``GET /metrics`` merges every worker's Prometheus text, each sample labelled ``worker="i"``.

Every forwarded answer carries ``x-polar-worker: i``. The router buffers each request body (it is
bounded by ``--max-body-mb``, and a buffered body can be resent when a pooled connection turns out to
be closed) and streams each answer back as it arrives (SSE stays SSE). Hop-by-hop headers are the
router's own: ``Connection``/``Expect`` are not forwarded, so worker connections stay alive and a
WebSocket attempt reaches the worker as a plain GET, which answers it the same 426.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any
from urllib.parse import unquote

import orjson
from starlette.requests import Request

from .canonical import RequestError
from .providers import ADAPTERS, parse_route
from .routes import authenticate, split_session_prefix

log = logging.getLogger("polarstream.gateway.router")

HEAD_LIMIT = 64 * 1024  # largest request or response head (a session key is ~200 bytes)
CHUNK = 256 * 1024  # answers larger than this are relayed in pieces
ROUTES_REMEMBERED = 65_536  # credentials -> worker entries kept before the memory is cleared
HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"expect", b"te", b"transfer-encoding",
              b"content-length", b"upgrade"}
FANOUT = {(b"POST", "/admin/pause"), (b"POST", "/admin/resume"), (b"POST", "/admin/policy_version"),
          (b"GET", "/admin/policy_version"), (b"GET", "/admin/status"), (b"GET", "/admin/adapters")}
SAME_ON_EVERY_WORKER = {"policy_version", "version", "resumes_by_itself_in_s"}  # set by the fan-out writes: worker 0's is the answer
ANY_WORKER = {"event_log_stalled"}  # true if true on any worker (other flags: only if true on all)
NO_BODY_STATUS = {204, 304}


class BadRequest(Exception):
    """A request the router cannot frame: answered with ``status`` and the connection closed."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Head:
    """A parsed HTTP/1.1 request head; ``headers`` are (lowercased name, value) byte pairs."""

    __slots__ = ("method", "target", "version", "headers", "lines")

    def __init__(self, raw: bytes):
        lines = raw[:-4].split(b"\r\n")
        try:
            self.method, self.target, self.version = lines[0].split(b" ", 2)
            pairs = [line.split(b":", 1) for line in lines[1:]]
            self.headers = [(name.strip().lower(), value.strip()) for name, value in pairs]
        except ValueError:
            raise BadRequest(400, "malformed request head") from None
        self.lines = lines

    def get(self, name: bytes) -> bytes | None:
        for n, v in self.headers:
            if n == name:
                return v
        return None

    @property
    def path(self) -> str:
        return unquote(self.target.partition(b"?")[0].decode("latin-1"))

    def wants_close(self) -> bool:
        conn = (self.get(b"connection") or b"").lower()
        return b"close" in conn or (self.version == b"HTTP/1.0" and b"keep-alive" not in conn)

    def forwarded(self, body_len: int | None) -> bytes:
        """The head sent to a worker: hop-by-hop headers dropped, the body's length stated."""
        kept = [line for line, (name, _) in zip(self.lines[1:], self.headers) if name not in HOP_BY_HOP]
        if body_len is not None:
            kept.append(b"content-length: %d" % body_len)
        return b"\r\n".join([self.lines[0], *kept, b"", b""])

    def scope(self) -> dict[str, Any]:
        """An ASGI scope with this head's headers and query, for the gateway's own key lookup."""
        return {"type": "http", "headers": self.headers, "query_string": self.target.partition(b"?")[2], "path": self.path}


class Response:
    """A worker's answer read whole (fan-out routes): status, head lines, body."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes):
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> Any:
        return orjson.loads(self.body)


class Worker:
    """One gateway process behind a unix socket, with a pool of idle kept-alive connections."""

    def __init__(self, index: int, path: str):
        self.index, self.path = index, path
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        """(reader, writer, reused): an idle connection if one is still open, else a new one."""
        while self.idle:
            reader, writer = self.idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer, True
            writer.close()
        reader, writer = await asyncio.open_unix_connection(self.path, limit=HEAD_LIMIT)
        return reader, writer, False

    def release(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.idle.append((reader, writer))


class SessionRouter:
    """Forward each request to the worker of its session; see the module docstring."""

    def __init__(self, sockets: list[str], *, secret: str, open_mode: bool, max_body_bytes: int,
                 body_timeout_s: float = 120.0):
        self.workers = [Worker(i, path) for i, path in enumerate(sockets)]
        self.secret, self.max_body_bytes, self.body_timeout_s = secret, max_body_bytes, body_timeout_s
        self._auth_view = SimpleNamespace(config=SimpleNamespace(open_mode=open_mode))  # what authenticate reads
        self._server: asyncio.base_events.Server | None = None
        self._routes: dict[tuple, int] = {}  # credentials -> worker index (see worker_for)

    # ------------------------------------------------------------------ serving

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0 = a free port); returns the port."""
        self._server = await asyncio.start_server(self._serve_client, host, port, limit=HEAD_LIMIT, backlog=1024)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in self.workers:
            for _, writer in w.idle:
                writer.close()
            w.idle.clear()

    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head: Head | None = None
        try:
            while True:
                head = None
                try:
                    raw = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return  # the client closed its connection between requests
                except asyncio.LimitOverrunError:
                    raise BadRequest(431, "request head too large") from None
                head = Head(raw)
                body = await self._read_body(head, reader, writer)
                keep = await self._dispatch(head, body, writer)
                if not keep or head.wants_close():
                    return
        except BadRequest as e:  # the rest of the request is unread: answer, then close the connection
            await self._send_error(writer, head, e.status, str(e), close=True)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away mid-request or mid-answer
        finally:
            writer.close()

    async def _read_body(self, head: Head, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes | None:
        """The whole request body (None: the request has none); chunked bodies are de-chunked."""
        if (head.get(b"expect") or b"").lower() == b"100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits a second for this before a large body
        try:
            async with asyncio.timeout(self.body_timeout_s):
                if b"chunked" in (head.get(b"transfer-encoding") or b"").lower():
                    return await self._read_chunked(reader)
                declared = head.get(b"content-length")
                if declared is None:
                    return None
                if not declared.isdigit():
                    raise BadRequest(400, "malformed content-length")
                if int(declared) > self.max_body_bytes:
                    raise BadRequest(413, f"request body exceeds the gateway's limit of {self.max_body_bytes} bytes")
                return await reader.readexactly(int(declared))
        except TimeoutError:
            raise BadRequest(408, f"request body not received within {self.body_timeout_s:g}s") from None

    async def _read_chunked(self, reader: asyncio.StreamReader) -> bytes:
        body = bytearray()
        while True:
            size = _chunk_size(await reader.readuntil(b"\r\n"))
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers: dropped
                    pass
                return bytes(body)
            body += (await reader.readexactly(size + 2))[:-2]
            if len(body) > self.max_body_bytes:
                raise BadRequest(413, f"request body exceeds the gateway's limit of {self.max_body_bytes} bytes")

    # ------------------------------------------------------------------ routing

    def session_worker(self, session_id: str) -> Worker:
        return self.workers[zlib.crc32(session_id.encode()) % len(self.workers)]

    def worker_for(self, head: Head) -> Worker:
        """The worker of the request's session, the way the gateway itself derives the session.

        Remembered per set of credentials: a session sends the same key on every call, and verifying
        it (HMAC, JSON claims) costs more than the rest of the routing together."""
        path_key, _ = split_session_prefix(head.path)
        credentials = (path_key, head.target.partition(b"?")[2],
                       *(head.get(name) for name in (b"authorization", b"x-api-key", b"x-goog-api-key", b"x-session-id")))
        index = self._routes.get(credentials)
        if index is None:
            try:
                claims = authenticate(self._auth_view, self.secret, path_key, Request(head.scope()))  # type: ignore[arg-type]
                index = self.session_worker(claims.session_id).index
            except RequestError:  # no usable key: any worker answers the same 401
                index = 0
            if len(self._routes) >= ROUTES_REMEMBERED:
                self._routes.clear()
            self._routes[credentials] = index
        return self.workers[index]

    async def _dispatch(self, head: Head, body: bytes | None, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the client connection must close afterwards."""
        path = head.path
        if path.startswith("/admin/"):
            if (head.method, path.rstrip("/")) in FANOUT:
                return await self._fan_out(head, body, writer, merge_json)
            if path.startswith("/admin/sessions/"):
                return await self._forward(self.session_worker(path.split("/")[3]), head, body, writer)
            return await self._forward(self.workers[0], head, body, writer)
        if head.method == b"GET":
            rest = split_session_prefix(path)[1].rstrip("/")
            if rest.endswith("/health"):
                return await self._fan_out(head, body, writer, merge_json, unavailable=503)
            if rest == "/metrics":
                return await self._fan_out(head, body, writer, merge_metrics)
        return await self._forward(self.worker_for(head), head, body, writer)

    # ------------------------------------------------------------------ one worker

    async def _forward(self, worker: Worker, head: Head, body: bytes | None, writer: asyncio.StreamWriter) -> bool:
        """Send the request to ``worker`` and stream its answer to the client."""
        try:
            reader, wwriter, raw = await self._request(worker, head.forwarded(None if body is None else len(body)), body)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            reason = getattr(e, "strerror", None) or type(e).__name__
            await self._send_error(writer, head, 502, f"gateway worker {worker.index} is not answering ({reason})", close=True)
            return False
        try:
            client_keep, worker_keep = await self._relay(raw, reader, writer, worker.index, head.method)
        except (ConnectionError, asyncio.IncompleteReadError):
            wwriter.close()
            return False  # mid-answer: the client cannot be told more than a cut connection
        if worker_keep:
            worker.release(reader, wwriter)
        else:
            wwriter.close()
        return client_keep

    @staticmethod
    async def _request(worker: Worker, request: bytes, body: bytes | None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
        """Send a request and read its answer's head: (reader, writer, head). A pooled connection the
        worker had closed (it never saw the request) is retried once on a new one."""
        for attempt in (0, 1):
            reader, writer, reused = await worker.connect()
            try:
                if body and len(body) < CHUNK:
                    writer.write(request + body)  # one write: one syscall, one packet on the unix socket
                else:
                    writer.write(request)
                    if body:
                        writer.write(body)
                return reader, writer, await reader.readuntil(b"\r\n\r\n")
            except (ConnectionError, asyncio.IncompleteReadError) as e:
                writer.close()
                if not (reused and attempt == 0 and not getattr(e, "partial", b"")):
                    raise
        raise AssertionError("unreachable")

    async def _relay(self, raw: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int,
                     method: bytes) -> tuple[bool, bool]:
        """Stream one answer (head ``raw`` already read) to the client; (client keep-alive, worker keep-alive)."""
        tag = b"x-polar-worker: %d\r\n\r\n" % index
        while True:
            status, headers = _response_head(raw)
            if status >= 200:
                break
            writer.write(raw[:-2] + tag)  # an interim answer; the real one follows
            raw = await reader.readuntil(b"\r\n\r\n")
        closing = b"close" in (_find(headers, b"connection") or b"").lower()
        out = raw[:-2] + tag
        length = _find(headers, b"content-length")
        if method == b"HEAD" or status in NO_BODY_STATUS:
            writer.write(out)
        elif b"chunked" in (_find(headers, b"transfer-encoding") or b"").lower():
            writer.write(out)
            await _relay_chunks(reader, writer)
        elif length is not None:
            remaining = int(length)
            if remaining <= CHUNK:
                writer.write(out + await reader.readexactly(remaining))
            else:
                writer.write(out)
                while remaining:
                    piece = await reader.read(min(remaining, CHUNK))
                    if not piece:
                        raise asyncio.IncompleteReadError(b"", remaining)
                    writer.write(piece)
                    remaining -= len(piece)
                    await writer.drain()
        else:  # framed by the worker closing its connection
            writer.write(out)
            while piece := await reader.read(CHUNK):
                writer.write(piece)
                await writer.drain()
            closing = True
        await writer.drain()
        return not closing, not closing

    # ------------------------------------------------------------------ every worker

    async def exchange(self, worker: Worker, request: bytes) -> Response:
        """Send a whole request to ``worker`` and read its whole answer (fan-out routes)."""
        reader, writer, raw = await self._request(worker, request, None)
        try:
            status, headers = _response_head(raw)
            length = _find(headers, b"content-length")
            closing = b"close" in (_find(headers, b"connection") or b"").lower()
            if b"chunked" in (_find(headers, b"transfer-encoding") or b"").lower():
                body = await _read_chunks(reader)
            elif length is not None:
                body = await reader.readexactly(int(length))
            else:  # framed by the worker closing its connection
                body, closing = await reader.read(), True
        except BaseException:
            writer.close()
            raise
        if closing:
            writer.close()
        else:
            worker.release(reader, writer)
        return Response(status, headers, body)

    async def _fan_out(self, head: Head, body: bytes | None, writer: asyncio.StreamWriter,
                       merge: Callable[[list[Response]], tuple[bytes, bytes]], unavailable: int = 502) -> bool:
        """Send the request to every worker at once; answer their merged bodies (or the first non-200)."""
        request = head.forwarded(None if body is None else len(body)) + (body or b"")
        answers = await asyncio.gather(*(self.exchange(w, request) for w in self.workers), return_exceptions=True)
        failed = [(i, a) for i, a in enumerate(answers) if isinstance(a, BaseException)]
        if failed:
            i, err = failed[0]
            await self._send_error(writer, head, unavailable, f"gateway worker {i} is not answering ({type(err).__name__}: {err})")
            return True
        ok: list[Response] = answers  # type: ignore[assignment]
        refused = next((a for a in ok if a.status != 200), None)
        if refused is not None:
            ctype = _find(refused.headers, b"content-type") or b"application/json"
            await _send(writer, refused.status, refused.body, ctype)
            return True
        merged, ctype = merge(ok)
        await _send(writer, 200, merged, ctype)
        return True

    async def _send_error(self, writer: asyncio.StreamWriter, head: Head | None, status: int, message: str,
                          close: bool = False) -> None:
        """An error the router itself answers, in the caller's provider shape (as a worker would)."""
        headers = Request(head.scope()).headers if head is not None else {}
        rest = split_session_prefix(head.path)[1] if head is not None else "/"
        adapter = ADAPTERS[parse_route(rest, headers).provider]
        kind = "api_error" if status >= 500 else "invalid_request_error"
        body = orjson.dumps(adapter.render_error(RequestError(status, message, kind)))
        try:
            await _send(writer, status, body, b"application/json", close=close)
        except ConnectionError:
            pass


# ---------------------------------------------------------------------- HTTP framing


def _response_head(raw: bytes) -> tuple[int, list[tuple[bytes, bytes]]]:
    lines = raw[:-4].split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers.append((name.strip().lower(), value.strip()))
    return status, headers


def _find(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for n, v in headers:
        if n == name:
            return v
    return None


def _chunk_size(line: bytes) -> int:
    try:
        return int(line.split(b";", 1)[0].strip(), 16)
    except ValueError:
        raise BadRequest(400, "malformed chunked body") from None


async def _relay_chunks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy a chunked body as it comes (each SSE event reaches the client when the worker sends it)."""
    while True:
        line = await reader.readuntil(b"\r\n")
        size = _chunk_size(line)
        if size == 0:
            writer.write(line)
            while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                writer.write(trailer)
            writer.write(b"\r\n")
            return
        writer.write(line + await reader.readexactly(size + 2))
        await writer.drain()


async def _read_chunks(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while size := _chunk_size(await reader.readuntil(b"\r\n")):
        body += (await reader.readexactly(size + 2))[:-2]
    while await reader.readuntil(b"\r\n") != b"\r\n":
        pass
    return bytes(body)


REASONS = {200: b"OK", 400: b"Bad Request", 408: b"Request Timeout", 413: b"Payload Too Large",
           431: b"Request Header Fields Too Large", 502: b"Bad Gateway", 503: b"Service Unavailable"}


async def _send(writer: asyncio.StreamWriter, status: int, body: bytes, ctype: bytes, close: bool = False) -> None:
    head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n" % (
        status, REASONS.get(status, b"Error"), ctype, len(body), b"connection: close\r\n" if close else b"")
    writer.write(head + body)
    await writer.drain()


# ---------------------------------------------------------------------- merging


def merge_json(answers: list[Response]) -> tuple[bytes, bytes]:
    """Every worker's JSON object as one (see the module docstring), with ``workers`` listing each."""
    bodies = [a.json() for a in answers]
    merged: dict[str, Any] = {}
    for key, first in bodies[0].items():
        values = [b.get(key) for b in bodies]
        if isinstance(first, bool):
            merged[key] = any(values) if key in ANY_WORKER else all(values)
        elif isinstance(first, (int, float)) and key not in SAME_ON_EVERY_WORKER:
            merged[key] = sum(v for v in values if isinstance(v, (int, float)))
        elif isinstance(first, dict) and all(isinstance(v, (int, float)) for b in values if isinstance(b, dict)
                                             for v in b.values()):  # counts per name (adapters in flight)
            merged[key] = {}
            for b in values:
                for name, n in (b or {}).items():
                    merged[key][name] = merged[key].get(name, 0) + n
        elif key == "status":
            merged[key] = first if all(v == first for v in values) else "degraded"
        else:
            merged[key] = first
    merged["processes"] = len(bodies)
    merged["workers"] = [{"worker": i, **b} for i, b in enumerate(bodies)]
    return orjson.dumps(merged), b"application/json"


def merge_metrics(answers: list[Response]) -> tuple[bytes, bytes]:
    """Every worker's Prometheus text as one exposition: each sample labelled ``worker="i"``, each
    family's samples together under its HELP/TYPE lines (a family split in two is invalid)."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for i, answer in enumerate(answers):
        current: tuple[list[str], list[str]] = families.setdefault("", ([], []))
        for line in answer.body.decode().splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                name = line.split(" ", 3)[2]
                current = families.setdefault(name, ([], []))
                if i == 0:
                    current[0].append(line)
            elif line and not line.startswith("#"):
                current[1].append(_label_worker(line, i))
    text = "".join(line + "\n" for comments, samples in families.values() for line in (*comments, *samples))
    ctype = _find(answers[0].headers, b"content-type") or b"text/plain; version=0.0.4; charset=utf-8"
    return text.encode(), ctype


def _label_worker(sample: str, index: int) -> str:
    name, brace, rest = sample.partition("{")
    if brace:
        return f'{name}{{worker="{index}",{rest}' if not rest.startswith("}") else f'{name}{{worker="{index}"{rest}'
    name, _, value = sample.partition(" ")
    return f'{name}{{worker="{index}"}} {value}'


# ---------------------------------------------------------------------- running


def event_loop_runner() -> asyncio.Runner:
    """An asyncio runner on uvloop where it is installed (a faster loop), else the standard loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


async def serve_until(router: SessionRouter, host: str, port: int, stop: Callable[[], Awaitable[None]]) -> None:
    """Serve on ``host:port`` until ``stop()`` returns."""
    await router.start(host, port)
    try:
        await stop()
    finally:
        await router.close()
