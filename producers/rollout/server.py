"""The rollout server: ``polarstream rollout``, an HTTP API in front of polar.tasks and polar.sessions.

    POST   /tasks            submit one TaskRequest (or a list): to polar.tasks, fanned out to polar.sessions
    GET    /tasks            progress of every known task
    GET    /tasks/{task_id}  progress of one task, per sample
    DELETE /tasks/{task_id}  cancel: a cancel marker on polar.tasks that every node honours
    GET    /health
    GET    /metrics          Prometheus metrics (producers/rollout/metrics.py, docs/operations.md)

A submission is answered (202) only once the task and all its sessions are acknowledged by Kafka, so a
202 means the work exists. Progress comes from polar.session-events, read from the beginning by a
background consumer (a restarted server rebuilds its view from the topics); once ``early_stop`` usable
samples of a task are in, the server cancels the rest. The OpenAPI document is at /openapi.json.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from infra import metrics as prometheus
from infra.settings import Settings
from schemas import SessionEvent, TaskRequest, encode

from . import metrics
from .fanout import FanOutError, cancel_marker, fan_out
from .progress import TaskState, apply_event, new_task_state

log = logging.getLogger("polarstream.rollout")
MAX_TASKS_PER_SUBMISSION = 1_000  # a list larger than this is refused whole (400)


class ApiError(Exception):
    """An error answered as ``{"error": {"code", "message"}}`` with an HTTP status."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class Rollout:
    """The server's state: known tasks and their progress; publishing through one Publisher."""

    def __init__(self, settings: Settings, publisher):
        self.settings, self.publisher = settings, publisher
        self.tasks: dict[str, TaskState] = {}
        self.events_seen = 0

    def check(self, tasks: list[TaskRequest]) -> list[list[Any]]:
        """Every task's sessions, once all of them are known to be submittable; else ApiError, nothing published.

        A list is checked whole first, so a bad or duplicate entry cannot leave the ones before it
        published behind an error answer.
        """
        if len(tasks) > MAX_TASKS_PER_SUBMISSION:
            raise ApiError(400, "invalid_task", f"{len(tasks)} tasks in one submission; the limit is {MAX_TASKS_PER_SUBMISSION}")
        ids = [t.task_id for t in tasks]
        if len(set(ids)) != len(ids):
            raise ApiError(400, "invalid_task", "task_id: the same task_id appears twice in this submission")
        return [self._sessions(t) for t in tasks]

    def _sessions(self, task: TaskRequest) -> list[Any]:
        if task.cancelled:
            raise ApiError(400, "invalid_task", "cancelled: a submitted task must not be a cancel marker")
        if task.task_id in self.tasks:
            raise ApiError(409, "duplicate_task", f"task {task.task_id!r} was already submitted; use a new task_id")
        try:
            sessions = fan_out(task, self.settings.session_secret, self.settings.session_key_ttl_s,
                               run=self.settings.topic_prefix)
            for record in (task, *sessions[:1]):  # the first session embeds the task: one level deeper
                encode(record)
        except FanOutError as e:
            raise ApiError(400, "invalid_task", str(e)) from None
        except (TypeError, ValueError, UnicodeError) as e:
            # Lone surrogates, nesting past what can be serialized: found by tests/fuzz (they were 503s).
            raise ApiError(400, "invalid_task", f"the task cannot be recorded as JSON ({e})") from None
        return sessions

    async def submit(self, task: TaskRequest, sessions: list[Any] | None = None) -> dict[str, Any]:
        """Publish the task and its sessions; ApiError for a duplicate, a bad mix or Kafka trouble."""
        if sessions is None:
            sessions = self._sessions(task)
        state = self.tasks[task.task_id] = new_task_state(task, [s.session_id for s in sessions])
        try:
            await self.publisher.publish(task)
            await self.publisher.publish_many(sessions)
        except Exception as e:
            # Sessions already on the topic will run; keep the state so status shows them and a retry is refused.
            log.error("task %s: publishing failed: %s", task.task_id, e)
            raise ApiError(503, "kafka_unavailable", f"task {task.task_id}: could not publish to Kafka ({e}); "
                                                     "check `polarstream status` before retrying") from None
        return {"task_id": task.task_id, "group_id": task.group_id, "sessions": [s.session_id for s in sessions],
                "submitted_at": state.submitted_at}

    async def cancel(self, task_id: str, reason: str = "cancelled") -> dict[str, Any]:
        """Publish the task's cancel marker once; returns its progress."""
        state = self.tasks.get(task_id)
        if state is None:
            raise ApiError(404, "unknown_task", f"task {task_id!r} is not known to this server")
        if not state.cancelled:
            await self.publisher.publish(cancel_marker(state.task, reason))
            state.cancelled = reason
        return state.summary()

    def status(self, task_id: str) -> dict[str, Any]:
        """Progress of one task, per sample."""
        state = self.tasks.get(task_id)
        if state is None:
            raise ApiError(404, "unknown_task", f"task {task_id!r} is not known to this server")
        return state.summary(samples=True)

    # -- fed by the background consumer ---------------------------------------------------------

    def on_task(self, task: TaskRequest) -> None:
        """A task (or cancel marker) read back from polar.tasks: learn tasks submitted elsewhere/earlier."""
        state = self.tasks.get(task.task_id)
        if task.cancelled:
            if state is not None:
                state.cancelled = state.cancelled or task.cancelled
            return
        if state is None:
            try:
                sessions = fan_out(task, self.settings.session_secret, self.settings.session_key_ttl_s,
                                   run=self.settings.topic_prefix)
            except FanOutError:
                return
            self.tasks[task.task_id] = new_task_state(task, [s.session_id for s in sessions])

    async def on_event(self, ev: SessionEvent) -> None:
        """Fold a SessionEvent into its task's progress; cancel the rest once early_stop is reached."""
        self.events_seen += 1
        state = self.tasks.get(ev.task_id)
        if state is None or not apply_event(state, ev):
            return
        if state.should_stop_early():
            log.info("task %s: %d usable samples in, early stop", ev.task_id, state.usable)
            await self.cancel(ev.task_id, f"early_stop: {state.usable} usable samples")


async def _follow(rollout: Rollout, settings: Settings, stop: asyncio.Event) -> None:
    from producers.consumer import RecordConsumer

    consumer = RecordConsumer(settings, topics=["tasks", "session-events"], group_id=f"polar-rollout-{uuid.uuid4().hex[:8]}",
                              from_beginning=True)
    try:
        while not stop.is_set():
            items = await asyncio.to_thread(consumer.poll, 0.5)
            for item in items:
                if isinstance(item.record, TaskRequest):
                    rollout.on_task(item.record)
                elif isinstance(item.record, SessionEvent):
                    await rollout.on_event(item.record)
    finally:
        await asyncio.to_thread(consumer.close)


def create_rollout_app(settings: Settings, *, control_token: str | None = None, publisher_factory=None) -> FastAPI:
    """The rollout API. ``control_token``: when set, POST and DELETE need ``X-Polar-Control-Token``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if publisher_factory is None:
            from producers.publisher import Publisher

            publisher = Publisher(settings, client_id="polar-rollout")
        else:
            publisher = publisher_factory(settings)
        app.state.rollout = Rollout(settings, publisher)
        metrics.watch(app.state.rollout)
        stop = asyncio.Event()
        follower = asyncio.ensure_future(_follow(app.state.rollout, settings, stop))
        try:
            yield
        finally:
            stop.set()
            await asyncio.gather(follower, return_exceptions=True)
            await publisher.aclose()

    app = FastAPI(title="polarstream rollout", version="1", lifespan=lifespan,
                  description="Submit tasks, follow their sessions, cancel them.")
    prometheus.mount(app)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"error": {"code": exc.code, "message": exc.message}}, status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes and wrong methods too answer in the API's own shape (schemathesis found {"detail"}).
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, f"http_{exc.status_code}")
        return JSONResponse({"error": {"code": code, "message": str(exc.detail)}}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        # Model validators put their own name in the path ("function-after[_defaults(), TaskRequest]"): drop it.
        where = ".".join(str(p) for p in err["loc"] if p != "body" and not str(p).startswith("function-"))
        return JSONResponse({"error": {"code": "invalid_task", "message": f"{where}: {err['msg']}"}}, status_code=400)

    def check(token: str | None) -> None:
        if control_token and token != control_token:
            raise ApiError(401, "unauthorized", "missing or wrong X-Polar-Control-Token")

    @app.post("/tasks", status_code=202)
    async def submit(body: TaskRequest | list[TaskRequest], request: Request,
                     x_polar_control_token: Annotated[str | None, Header()] = None) -> Any:
        """Submit a task (or a list of tasks); answered once everything is durably in Kafka."""
        check(x_polar_control_token)
        rollout: Rollout = request.app.state.rollout
        tasks = body if isinstance(body, list) else [body]
        answers = [await rollout.submit(t, s) for t, s in zip(tasks, rollout.check(tasks))]
        return answers if isinstance(body, list) else answers[0]

    @app.get("/tasks")
    async def list_tasks(request: Request) -> list[dict[str, Any]]:
        """Progress of every task this server knows."""
        return [s.summary() for s in request.app.state.rollout.tasks.values()]

    @app.get("/tasks/{task_id}")
    async def get_task(task_id: str, request: Request) -> dict[str, Any]:
        """Progress of one task with the state of each sample."""
        return request.app.state.rollout.status(task_id)

    @app.delete("/tasks/{task_id}")
    async def cancel_task(task_id: str, request: Request, reason: str = "cancelled",
                          x_polar_control_token: Annotated[str | None, Header()] = None) -> dict[str, Any]:
        """Cancel a task: nodes stop its sessions in whatever stage they are."""
        check(x_polar_control_token)
        return await request.app.state.rollout.cancel(task_id, reason)

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        """Liveness and how much the server has read."""
        r: Rollout = request.app.state.rollout
        return {"status": "ok", "tasks": len(r.tasks), "events_seen": r.events_seen}

    return app


def parse_task(line: str, where: str) -> TaskRequest:
    """One TaskRequest from JSON text; ValueError naming ``where`` and the field."""
    try:
        return TaskRequest.model_validate_json(line)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
        raise ValueError(f"{where}: {field}: {err['msg']}" if field else f"{where}: {err['msg']}") from None
