"""The node's stage pipeline: INIT → READY buffer → RUN → POSTRUN, each with its own pool.

Every admitted session is one coroutine that passes through the stages' slot pools::

    admission (run_workers + ready_target) ─┬─ INIT slots (init_workers)
                                            ├─ READY: prepared, waiting for a RUN slot
                                            └─ RUN slots (run_workers)       ── admission released
    POSTRUN slots (postrun_workers) ─ events ─ teardown ─ on_done (commit)

Admission bounds what a node takes from Kafka: the runs plus ``ready_target`` prepared sessions waiting
for them, so INIT of the next sessions overlaps the current runs ("prewarming") and a run slot rarely
waits for a workspace. A slow INIT holds an INIT slot, never a RUN slot. Evaluation happens after the
admission is released: it does not use the engine, so it must not hold back the next run.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from gateway.runtimes import Runtime
from schemas import SessionEvent

from .config import NodeConfig
from .session import Job, init_stage, postrun_stage, run_stage, run_session_id, session_event, teardown

log = logging.getLogger("polarstream.node")

# A session's stages as the node's metrics name them, and the job.metrics key that times each (session.py)
STAGE_METRICS = {"open": "open_s", "run": "run_s", "verify": "eval_s", "close": "close_s"}


class PrioritySlots:
    """A semaphore whose waiters are served by priority (higher first), then arrival order."""

    def __init__(self, n: int):
        self.free = n
        self._waiters: list[tuple[int, int, asyncio.Future]] = []
        self._seq = itertools.count()

    async def acquire(self, priority: int = 0) -> None:
        """Take a slot, waiting behind higher-priority (then earlier) waiters."""
        if self.free > 0 and not any(not f.done() for _, _, f in self._waiters):
            self.free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (-priority, next(self._seq), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted just as we were cancelled: pass it on
            raise

    def release(self) -> None:
        """Hand the slot to the best waiter, or return it to the pool."""
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1


async def _acquire_unless_cancelled(slots: PrioritySlots, job: Job) -> bool:
    """Wait for a slot or the job's cancellation; True when the slot was acquired."""
    get = asyncio.ensure_future(slots.acquire(job.task.priority))
    stop = asyncio.ensure_future(job.cancel.wait())
    await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if get.done() and not get.cancelled():
        return True
    get.cancel()
    await asyncio.gather(get, return_exceptions=True)
    return False


class Pipeline:
    """Runs admitted jobs through the stages and publishes their SessionEvents."""

    def __init__(self, cfg: NodeConfig, runtime: Runtime, gateway_port: int, publish: Callable[[SessionEvent], Awaitable],
                 settle_calls: Callable[[str], Awaitable[int | None]], on_done: Callable[[Job], Awaitable] | None = None):
        self.cfg, self.runtime, self.gateway_port = cfg, runtime, gateway_port
        self.publish, self.settle_calls, self.on_done = publish, settle_calls, on_done
        self.admitted = 0  # sessions holding an admission (INIT, READY or RUN)
        self.init_slots = PrioritySlots(cfg.init_workers)
        self.run_slots = PrioritySlots(cfg.run_workers)
        self.post_slots = asyncio.Semaphore(cfg.postrun_workers)
        self.jobs: dict[str, Job] = {}
        self.tasks: set[asyncio.Task] = set()
        self.stage = Counter({"init": 0, "ready": 0, "run": 0, "postrun": 0})
        self.finished: Counter[str] = Counter()
        self.verifier_faults: Counter[str] = Counter()  # sessions masked because the verifier could not judge, by cause
        self.run_busy_s = 0.0
        # (sandbox, stage) -> [seconds, sessions]: each session's stage times, summed (metrics.py)
        self.stage_seconds: dict[tuple[str, str], list] = {}
        self.started_at = time.monotonic()

    # -- admission ---------------------------------------------------------------------------------

    def has_room(self) -> bool:
        """Whether the node may take another session (admission below run_workers + ready_target)."""
        return self.admitted < self.cfg.capacity

    def admit(self, job: Job) -> asyncio.Task:
        """Start ``job``'s lifecycle (the caller checked ``has_room``; over-admission is allowed, not lost)."""
        self.admitted += 1
        self.jobs[job.run_id] = job
        task = asyncio.ensure_future(self._lifecycle(job))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def abandon(self, job: Job, reason: str) -> None:
        """Stop ``job`` without an outcome: its partition was revoked and another node re-runs it."""
        job.abandoned = True
        job.cancel_reason = reason
        job.cancel.set()

    def cancel_task(self, task_id: str, reason: str) -> int:
        """Cancel every job of ``task_id`` in any stage; returns how many."""
        hit = [j for j in self.jobs.values() if j.assigned.task_id == task_id and not j.cancel.is_set()]
        for job in hit:
            job.cancel_reason = reason
            job.cancel.set()
        return len(hit)

    # -- the lifecycle -----------------------------------------------------------------------------

    async def _lifecycle(self, job: Job) -> None:
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.admitted -= 1

        try:
            if job.lost_attempt is not None:  # mark the attempt that died with its node (never 'finished')
                await self._emit(session_event(job, "harness_exited", attempt=job.lost_attempt, tag="lost",
                                               session_id=run_session_id(job.assigned.session_id, job.lost_attempt),
                                               status="infra_error", detail=f"node lost; re-run as attempt {job.attempt}"))
            try:
                ran = await self._init_and_run(job)
            except Exception as e:  # an unexpected OS error or bug: mask this session, keep the node going
                log.exception("node %s: session %s failed in INIT/RUN", self.cfg.node_id, job.run_id)
                job.end("infra_error", f"node error: {e!r}")
                ran = False
            release()
            if job.abandoned:  # the partition's new owner re-runs it; a finished event here would race it
                await self._emit(session_event(job, "harness_exited", tag="abandoned", status="infra_error",
                                               detail=f"{self.cfg.node_id}: {job.cancel_reason}"))
                await teardown(job, self.cfg.keep_workdirs)
                return
            if ran:
                await self._emit(session_event(job, "harness_exited", status=job.status or "ok",
                                               metrics=dict(job.metrics), detail=job.detail[-500:]))
                self.stage["postrun"] += 1
                try:
                    async with self.post_slots:
                        await postrun_stage(job, self.cfg, self.runtime)
                except Exception as e:
                    log.exception("node %s: session %s failed in POSTRUN", self.cfg.node_id, job.run_id)
                    job.end("infra_error", f"node error in POSTRUN: {e!r}")
                finally:
                    self.stage["postrun"] -= 1
                if job.status == "ok" and job.reward is not None:
                    await self._emit(session_event(job, "evaluated", reward=job.reward,
                                                   metrics=dict(job.metrics)))
            job.end("cancelled", job.cancel_reason)  # no-op unless nothing else set a status
            job.metrics["total_s"] = time.monotonic() - job.times["admitted"]
            await self._emit(session_event(job, "finished", status=job.status, reward=job.reward,
                                           metrics=dict(job.metrics), num_calls=job.num_calls or 0,
                                           detail=f"{self.cfg.node_id}: {job.detail[-900:]}", verifier_fault=job.fault))
            self.finished[job.status or "?"] += 1
            if job.fault is not None:
                self.verifier_faults[job.fault.cause] += 1
            await teardown(job, self.cfg.keep_workdirs)
            self._record_stages(job)
        except asyncio.CancelledError:  # the node stopping without drain: a READY session's container too
            if job.sandbox is not None:
                await asyncio.shield(job.sandbox.close())
            raise
        finally:
            release()
            self.jobs.pop(job.run_id, None)
        if self.on_done is not None and not job.abandoned:
            await self.on_done(job)

    async def _init_and_run(self, job: Job) -> bool:
        """INIT then (after READY) RUN; True when the harness ran. Holds the admission throughout."""
        if job.cancel.is_set() or not await _acquire_unless_cancelled(self.init_slots, job):
            return False
        self.stage["init"] += 1
        try:
            ok = await init_stage(job, self.cfg, self.runtime)
        finally:
            self.stage["init"] -= 1
            self.init_slots.release()
        if not ok:
            return False
        job.times["ready"] = time.monotonic()
        self.stage["ready"] += 1
        try:
            got = await _acquire_unless_cancelled(self.run_slots, job)
        finally:
            self.stage["ready"] -= 1
        if not got:
            return False
        self.stage["run"] += 1
        t0 = time.monotonic()
        try:
            job.metrics["ready_wait_s"] = t0 - job.times["ready"]
            detail = f"{self.cfg.node_id}" + (f"; re-run of attempt {job.lost_attempt}" if job.lost_attempt is not None else "")
            await self._emit(session_event(job, "started", metrics=dict(job.metrics), detail=detail))
            await run_stage(job, self.cfg, self.runtime, self.gateway_port, self.settle_calls)
        finally:
            self.run_busy_s += time.monotonic() - t0
            self.stage["run"] -= 1
            self.run_slots.release()
        return True

    def _record_stages(self, job: Job) -> None:
        """Add the session's open, run, verify and close seconds to the totals by sandbox (bwrap, podman)."""
        sandbox = getattr(job.sandbox, "name", "") or getattr(self.runtime, "name", "?")
        for stage, key in STAGE_METRICS.items():
            if key in job.metrics:
                total = self.stage_seconds.setdefault((sandbox, stage), [0.0, 0])
                total[0] += job.metrics[key]
                total[1] += 1

    async def _emit(self, event: SessionEvent) -> None:
        """Publish until the broker acknowledges: a finished event must never be lost (ids dedupe retries)."""
        delay = 0.5
        while True:
            try:
                await self.publish(event)
                return
            except Exception as e:  # PublishError, or the broker down: wait and retry
                log.warning("node %s: publishing %s of %s failed (%s); retrying", self.cfg.node_id, event.kind,
                            event.session_id, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    # -- observation -------------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Stage counts, finished sessions by status and run-slot utilization since start."""
        elapsed = max(time.monotonic() - self.started_at, 1e-9)
        return {**{f"stage.{k}": float(v) for k, v in self.stage.items()},
                **{f"finished.{k}": float(v) for k, v in self.finished.items()},
                "admitted": float(self.admitted), "run_slot_utilization": self.run_busy_s / (self.cfg.run_workers * elapsed)}

    async def drain(self) -> None:
        """Wait for every admitted session to finish."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)
