"""Check a task before training on it: its evaluator must score the untouched workspace 0 and the
workspace with the task's solution applied 1 (Harbor's oracle run), in the sandbox the node uses.

A task that scores its untouched workspace above 0 teaches nothing (every sample passes); one whose own
solution does not score 1 has a broken verifier or solution. ``polarstream tasks --check`` runs this.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from gateway.evaluators import EvalResult, evaluate
from gateway.runtimes import AutoRuntime, ContainerRuntime, ExecSpec, ImageBuildError, Limits, Runtime, RuntimeUnavailable, command_env
from schemas import TaskRequest

from .workspace import WorkspaceError, materialize, prepare


@dataclass
class OracleResult:
    task_id: str
    untouched: EvalResult
    solved: EvalResult | None  # None: the task has no solution/solve.sh
    seconds: dict[str, float] = field(default_factory=dict)  # build (its image) and run (both scorings)

    @property
    def ok(self) -> bool:
        """The untouched workspace scores 0 and the solution (where there is one) scores 1."""
        return self.untouched.reward == 0.0 and (self.solved is None or self.solved.reward == 1.0)

    @property
    def error(self) -> str:
        """Why the task could not start at all (its image does not build, its prepare fails), else "";
        then the solution was not tried: it would meet the same failure."""
        err = self.untouched.error or ""
        return err if err.startswith("init:") else ""


async def check_task(task: TaskRequest, runtime: Runtime, scratch: Path) -> OracleResult:
    """Evaluate ``task``'s workspace as INIT leaves it, then again after its ``solution/solve.sh``."""
    seconds = {"build": 0.0, "run": 0.0}
    untouched = await _score(task, runtime, scratch / "untouched", None, seconds)
    solution = Path(task.metadata["solution"]) / "solve.sh" if task.metadata.get("solution") else None
    if (untouched.error or "").startswith("init:"):  # no sandbox for this task: the solution cannot have one either
        return OracleResult(task.task_id, untouched, None, seconds)
    solved = await _score(task, runtime, scratch / "solved", solution, seconds) if solution and solution.is_file() else None
    return OracleResult(task.task_id, untouched, solved, seconds)


async def _score(task: TaskRequest, runtime: Runtime, scratch: Path, solve_sh: Path | None, seconds: dict) -> EvalResult:
    """Score one fresh sandbox of ``task`` (after its solution, when given); the sandbox is removed after."""
    shutil.rmtree(scratch, ignore_errors=True)
    workspace, home = scratch / "workspace", scratch / "home"
    home.mkdir(parents=True)
    t0 = time.monotonic()
    if task.environment is not None and not isinstance(runtime, (AutoRuntime, ContainerRuntime)):
        return EvalResult(None, error=f"init: the task brings an image (environment/Dockerfile); runtime "
                                      f"{getattr(runtime, 'name', '?')} runs none: use runtime auto or podman")
    try:
        box = await runtime.open(task, scratch, log_path=scratch / "build.log")
    except (RuntimeUnavailable, ImageBuildError) as e:
        seconds["build"] += time.monotonic() - t0  # a failed build's time (near 0 when nothing was built)
        return EvalResult(None, error=f"init: {e}")
    built_s = getattr(box, "build_s", 0.0)
    seconds["build"] += built_s
    try:
        return await _score_in(task, box, scratch, workspace, home, solve_sh)
    finally:
        await box.close()
        seconds["run"] += time.monotonic() - t0 - built_s  # opening the sandbox, the runs, closing it


async def _score_in(task: TaskRequest, runtime: Runtime, scratch: Path, workspace: Path, home: Path,
                    solve_sh: Path | None) -> EvalResult:
    try:
        if task.workspace.kind != "image":
            await materialize(task.workspace, workspace)
        await prepare(task.prepare, workspace, home, runtime, attempts=1, timeout_s=task.timeouts.init_s,
                      mount=task.workspace.mount)
    except WorkspaceError as e:
        return EvalResult(None, error=f"init: {e}")
    if solve_sh is not None:
        # The solution runs as Harbor's oracle does: in the task's working dir, its own files at /solution.
        spec = ExecSpec(argv=["/bin/bash", "/solution/solve.sh"], env=command_env(runtime, home), workspace=workspace, home=home,
                        limits=Limits(timeout_s=task.timeouts.agent_s), network="none", log_path=scratch / "solve.log",
                        mount=task.workspace.mount, mounts={"/solution": _copy(solve_sh.parent, scratch / "solution")})
        try:
            res = await runtime.run(spec)
        except RuntimeUnavailable as e:
            return EvalResult(None, error=f"solution runtime: {e}")
        if res.returncode != 0:
            return EvalResult(None, error=f"solution/solve.sh exited {res.returncode}: {res.output_tail[-300:].strip()}")
    return await evaluate(task.evaluator, workspace, scratch, task, runtime, scratch / "eval.log")


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest
