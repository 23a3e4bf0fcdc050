"""One session on a gateway node: INIT, RUN and POSTRUN as plain async functions.

The pipeline (pipeline.py) decides *when* each stage runs; this module says *what* it does. Each stage
records its outcome on the ``Job`` and never raises for a session's own failures: a bad workspace, a
harness that crashes or times out, an evaluator that hangs all end as a status on the finished event.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from gateway import harnesses
from gateway.evaluators import evaluate
from gateway.harnesses.install import prefix
from gateway.runtimes import ExecSpec, ImageBuildError, Limits, Runtime, RuntimeUnavailable
from schemas import SessionAssigned, SessionEvent, VerifierFault, derived_event_id
from schemas.records import SessionStatus

from .config import NodeConfig
from .workspace import WorkspaceError, materialize, prepare


def run_session_id(session_id: str, attempt: int) -> str:
    """The session id an attempt records under: the assigned id, plus ``.a<n>`` for re-runs.

    Calls of a re-run must not mix with the calls of the attempt that died (the gateway numbers calls
    from 0 per session), so each attempt is its own session to the gateway and the streams; groups
    match attempts of one sample by ``sample_index`` and keep the latest.
    """
    return session_id if attempt == 0 else f"{session_id}.a{attempt}"


@dataclass
class Job:
    """A session on this node and everything learnt about it so far."""

    assigned: SessionAssigned
    attempt: int
    key: str  # session key of this attempt (minted by the node for re-runs)
    partition: int = -1
    offset: int = -1
    lost_attempt: int | None = None
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    cancel_reason: str = ""
    abandoned: bool = False  # its partition moved to another node, which re-runs it: publish no outcome
    root: Path | None = None
    sandbox: Runtime | None = None  # where this session's programs run (its container, for an image task)
    status: SessionStatus | None = None
    reward: float | None = None
    detail: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    fault: VerifierFault | None = None  # the verifier never got to judge (status infra_error)
    num_calls: int | None = None
    times: dict[str, float] = field(default_factory=lambda: {"admitted": time.monotonic()})

    @property
    def task(self):
        return self.assigned.task

    @property
    def run_id(self) -> str:
        return run_session_id(self.assigned.session_id, self.attempt)

    def dir(self, name: str) -> Path:
        assert self.root is not None
        return self.root / name

    def end(self, status: SessionStatus, detail: str = "", reward: float | None = None) -> None:
        """Set the outcome once; later calls (a cancel racing a timeout) keep the first."""
        if self.status is None:
            self.status, self.detail, self.reward = status, detail, reward


def session_event(job: Job, kind: str, *, session_id: str | None = None, attempt: int | None = None, tag: str = "",
                  **fields) -> SessionEvent:
    """A SessionEvent of ``job`` with a deterministic id (a re-published event is the same event).

    ``tag`` distinguishes markers (a lost or abandoned attempt) from the attempt's own events of that kind.
    """
    sid = session_id or job.run_id
    att = job.attempt if attempt is None else attempt
    t = job.task
    return SessionEvent(
        event_id=derived_event_id("session-event", sid, att, kind, tag), session_id=sid, group_id=job.assigned.group_id,
        task_id=job.assigned.task_id, sample_index=job.assigned.sample_index, attempt=att, num_samples=t.num_samples,
        min_valid=t.min_valid, kind=kind, harness=t.harness.name, task_set=t.task_set, zero_signal=t.zero_signal,
        **fields)


# ----------------------------------------------------------------------------------------- INIT


async def init_stage(job: Job, cfg: NodeConfig, runtime: Runtime) -> bool:
    """Create the session's directories, build its workspace, run prepare commands. False on failure."""
    job.root = cfg.work_dir / "sessions" / job.run_id
    if job.root.exists():
        shutil.rmtree(job.root)  # a leftover of an earlier attempt on this machine
    for name in ("workspace", "home", "logs", "eval"):
        job.dir(name).mkdir(parents=True)
    t0 = time.monotonic()
    env = job.task.environment
    limit = job.task.timeouts.init_s + (env.build_timeout_s if env is not None else 0.0)  # a build has its own limit
    try:
        await asyncio.wait_for(_init(job, cfg, runtime), timeout=limit)
    except asyncio.TimeoutError:
        job.end("infra_error", f"INIT exceeded {limit:g}s")
    except WorkspaceError as e:
        job.end("infra_error", str(e))
    job.metrics["init_s"] = time.monotonic() - t0
    return job.status is None


def exposed_paths(job: Job, cfg: NodeConfig) -> tuple[list[Path], bool]:
    """Host paths the session's harness needs read-only (an npm CLI's tree), and whether it needs node."""
    name = job.task.harness.name
    if name in harnesses.NPM_HARNESSES:
        return [prefix(name, cfg.cache_dir)], True
    return [], False


async def _init(job: Job, cfg: NodeConfig, runtime: Runtime) -> None:
    ro_paths, node = exposed_paths(job, cfg)
    t0 = time.monotonic()
    try:
        job.sandbox = await runtime.open(job.task, job.root, ro_paths, node, log_path=job.dir("logs") / "build.log")
    except (RuntimeUnavailable, ImageBuildError) as e:
        raise WorkspaceError(str(e)) from None
    # open_s: the sandbox ready (a container's image lookup or build included); prepared: it was started ahead
    job.metrics["open_s"] = time.monotonic() - t0
    job.metrics["image_build_s"] = getattr(job.sandbox, "build_s", 0.0)
    job.metrics["open_prepared"] = 1.0 if getattr(job.sandbox, "was_prepared", False) else 0.0
    if job.task.workspace.kind != "image":
        await materialize(job.task.workspace, job.dir("workspace"))
    if job.task.prepare:
        job.metrics["prepare_retries"] = await prepare(
            job.task.prepare, job.dir("workspace"), job.dir("home"), job.sandbox, attempts=cfg.prepare_attempts,
            timeout_s=job.task.timeouts.init_s, log_path=job.dir("logs") / "prepare.log", mount=job.task.workspace.mount)


# ----------------------------------------------------------------------------------------- RUN


def harness_launch(job: Job, cfg: NodeConfig, runtime: Runtime, gateway_port: int) -> tuple[harnesses.Launch, ExecSpec]:
    """The harness invocation for this job, its config files written into the private HOME."""
    spec = job.task.harness
    ctx = harnesses.HarnessContext(
        base_url=runtime.gateway_url(gateway_port), session_key=job.key, model=str(spec.config.get("model", cfg.model_name)),
        instruction=job.task.instruction, workspace=runtime.workspace_view(job.dir("workspace"), job.task.workspace.mount),
        home=runtime.home_view(job.dir("home")), python=runtime.python, cache_dir=cfg.cache_dir, config=spec.config,
        command=tuple(spec.command), session_id=job.run_id, task_id=job.assigned.task_id)
    launch = harnesses.launch(spec.name, ctx)
    home = job.dir("home").resolve()
    for rel, content in launch.files.items():
        path = (home / rel).resolve()
        if not path.is_relative_to(home):
            raise harnesses.HarnessConfigError(f"harness file {rel!r} escapes HOME")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    limits = Limits(timeout_s=job.task.timeouts.agent_s, cpu_s=cfg.cpu_s, memory_mb=cfg.memory_mb)
    exec_spec = ExecSpec(argv=launch.argv, env=launch.env, workspace=job.dir("workspace"), home=job.dir("home"),
                         limits=limits, network="gateway", gateway_port=gateway_port, ro_paths=launch.ro_paths,
                         log_path=job.dir("logs") / "harness.log", mount=job.task.workspace.mount)
    return launch, exec_spec


async def run_stage(job: Job, cfg: NodeConfig, runtime: Runtime, gateway_port: int,
                    settle_calls: Callable[[str], Awaitable[int | None]]) -> None:
    """Run the harness until it exits, the agent timeout passes or the session is cancelled."""
    t0 = time.monotonic()
    runtime = job.sandbox or runtime
    try:
        _, spec = harness_launch(job, cfg, runtime, gateway_port)
    except (harnesses.HarnessConfigError, harnesses.HarnessNotInstalled) as e:
        job.end("infra_error", str(e))
        return
    run = asyncio.ensure_future(runtime.run(spec))
    cancelled = asyncio.ensure_future(job.cancel.wait())
    try:
        await asyncio.wait({run, cancelled}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        cancelled.cancel()
    if not run.done():  # cancelled: killing the run kills the harness's whole process tree
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        job.end("cancelled", job.cancel_reason or "cancelled")
    else:
        try:
            res = run.result()
        except RuntimeUnavailable as e:
            job.end("infra_error", str(e))
        else:
            job.metrics["exit_code"] = float(res.returncode if res.returncode is not None else -1)
            if res.timed_out:
                # The calls captured so far stay in Kafka; the sample trains with reward 0 by default.
                job.end("timeout", f"agent timeout after {job.task.timeouts.agent_s}s", reward=0.0)
            elif res.returncode != 0 and await _out_of_memory(runtime):
                job.end("failed", f"harness killed: out of memory (memory_mb={job.task.environment.memory_mb})")
                job.metrics["oom_killed"] = 1.0
            elif res.returncode != 0:
                job.end("failed", f"harness exited with code {res.returncode}: {res.output_tail[-300:]}")
    job.metrics["run_s"] = time.monotonic() - t0
    job.num_calls = await settle_calls(job.run_id)


# ----------------------------------------------------------------------------------------- POSTRUN


async def postrun_stage(job: Job, cfg: NodeConfig, runtime: Runtime) -> None:
    """Evaluate a session that ran to completion; others keep the status they ended with."""
    if job.status is not None or job.cancel.is_set():
        job.end("cancelled", job.cancel_reason)
        return
    t0 = time.monotonic()
    spec = job.task.evaluator
    res = await evaluate(spec, job.dir("workspace"), job.dir("eval"), job.task, job.sandbox or runtime,
                         job.dir("logs") / "eval.log")
    job.metrics["eval_s"] = time.monotonic() - t0
    job.metrics.update(getattr(job.sandbox, "parts", None) or {})  # a container's verify_*_s (exec_files.py)
    job.metrics.update(res.metrics)
    if res.error:
        job.end("infra_error", res.error)  # a broken evaluator is not the agent's fault: masked
        job.fault = res.fault  # and one that could not reach its packages is not either
    else:
        job.end("ok", res.detail, reward=res.reward)


async def _out_of_memory(sandbox: Runtime) -> bool:
    """Whether the container's memory limit killed a process (only a container can tell)."""
    check = getattr(sandbox, "oom_killed", None)
    return bool(check) and await check()


async def teardown(job: Job, keep: bool) -> None:
    """Remove the session's container and directories (a harness can't leave state for the next session)."""
    t0 = time.monotonic()
    if job.sandbox is not None:
        await job.sandbox.close()
    if job.root is not None and not keep:
        shutil.rmtree(job.root, ignore_errors=True)
    job.metrics["close_s"] = time.monotonic() - t0  # after the finished event: the node's metrics have it
