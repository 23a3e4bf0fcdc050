"""Evaluators: turn a finished workspace into a reward (POSTRUN).

Every evaluator runs on a fresh copy of the workspace, so a harness process that outlived its run (or
the evaluator itself) cannot change what is scored, and the original stays available for inspection.
Three kinds (``EvaluatorSpec.kind``):

- ``command``: a shell command run in the copy through the session's runtime (no network); reward 1.0
  when it exits 0, else 0.0.
- ``files``: expected relative path -> exact content; reward = fraction of files that match.
- ``python``: ``module:function`` called as ``fn(workspace_path, task)`` in a separate interpreter (so a
  hang can be killed and a crash can't take the node down); it returns a float, or a dict with
  ``reward`` and optional ``metrics``.

- ``harbor``: a Harbor / Terminal-Bench verifier. The copy is shown at the task's working dir
  (``WorkspaceSpec.mount``, e.g. /app), the task's tests at ``/tests`` and a writable ``/logs/verifier``,
  and ``command`` (``bash /tests/test.sh``) runs there, as Harbor runs it in its container. The reward
  is ``/logs/verifier/reward.txt`` (one number) or ``reward.json`` (its ``reward``, else the mean of
  its numbers) when the verifier writes one, clamped to [0, 1]; otherwise 1.0 when it exits 0.

In a session's container (an image task, ``runtime.persistent``) there is no copy: the verifier runs in
the container's final state, as Harbor's does and as published verifiers expect; ``files`` and
``python`` read the workspace copied out of it.

Before any evaluator of a session's container, what the agent left running in it is killed
(``EvaluatorSpec.agent_processes``, default kill; keep is Harbor's behaviour), so the verifier judges the
agent's files, not a process still writing them, and no agent process shares the verifier's network.

Outcomes: a verifier timeout is recorded (metric ``verifier_timeout``) with reward 0.0: the agent left a
workspace that does not verify in time. A broken evaluator (bad spec, crash, unparsable output) is an
infrastructure failure: ``error`` is set and the session is masked, never scored 0. So is a Harbor
verifier that scored 0 without judging (verifier_faults.py: its network, DNS, an install, TLS, a missing
interpreter, or a timeout before its tests started): ``fault`` holds the cause and the lines that show it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gateway.runtimes import ExecResult, ExecSpec, Limits, Runtime, RuntimeUnavailable, command_env
from gateway.runtimes.uvtool import ensure_uv, uses_uv
from gateway.verifier_faults import classify
from schemas import EvaluatorSpec, TaskRequest, VerifierFault


@dataclass
class EvalResult:
    reward: float | None  # None: not evaluated (kind none, or an evaluator error)
    metrics: dict[str, float] = field(default_factory=dict)
    error: str = ""  # non-empty: the evaluator itself failed (infrastructure), the session is masked
    detail: str = ""
    fault: VerifierFault | None = None  # the verifier never got to judge (then error is set too)


def fresh_copy(workspace: Path, dest: Path) -> Path:
    """Copy the workspace for evaluation (symlinks kept as links, so they can't pull in host files)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(workspace, dest, symlinks=True)
    return dest


def score_files(workspace: Path, expected: dict[str, str]) -> EvalResult:
    """Fraction of expected files whose content matches exactly."""
    if not expected:
        return EvalResult(None, error="evaluator.expected_files: empty")
    root = workspace.resolve()
    matched = 0
    for rel, content in expected.items():
        path = (root / rel).resolve()
        if not path.is_relative_to(root):
            return EvalResult(None, error=f"evaluator.expected_files: {rel!r} points outside the workspace")
        try:
            matched += path.is_file() and path.read_text() == content
        except (OSError, UnicodeDecodeError):
            pass
    return EvalResult(matched / len(expected), {"files_matched": float(matched), "files_expected": float(len(expected))})


async def _verify(runtime: Runtime, exec_spec: ExecSpec) -> ExecResult | EvalResult:
    """Run a verifier: its ExecResult, or the EvalResult of a runtime that cannot run it or a timeout."""
    try:
        res = await runtime.run(exec_spec)
    except RuntimeUnavailable as e:
        return EvalResult(None, error=f"evaluator runtime: {e}")
    if res.timed_out:
        limit = exec_spec.limits.timeout_s
        return EvalResult(0.0, {"verifier_timeout": 1.0}, detail=f"evaluator timed out after {limit}s")
    return res


async def run_command(spec: EvaluatorSpec, copy: Path, home: Path, runtime: Runtime, log_path: Path | None) -> EvalResult:
    """Run the test command in the copy; exit 0 is reward 1.0."""
    if not spec.command.strip():
        return EvalResult(None, error="evaluator.command: empty")
    res = await _verify(runtime, ExecSpec(argv=["/bin/sh", "-c", spec.command], env=command_env(runtime, home), workspace=copy,
                                          home=home, limits=Limits(timeout_s=spec.timeout_s), network="none", log_path=log_path))
    if isinstance(res, EvalResult):
        return res
    return EvalResult(1.0 if res.returncode == 0 else 0.0, {"eval_exit_code": float(res.returncode or 0)},
                      detail=res.output_tail[-500:])


async def run_harbor(spec: EvaluatorSpec, copy: Path, home: Path, scratch: Path, task: TaskRequest, runtime: Runtime,
                     log_path: Path | None) -> EvalResult:
    """Run a Harbor verifier over the copy (module docstring); the reward file, else the exit code."""
    if not spec.tests:
        return EvalResult(None, error="evaluator.tests: empty (a Harbor task's tests/ directory)")
    tests, logs = scratch / "eval-tests", scratch / "eval-logs"
    shutil.rmtree(tests, ignore_errors=True)
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    try:
        write_tree(tests, spec.tests)
    except ValueError as e:
        return EvalResult(None, error=f"evaluator.tests: {e}")
    mounts = {"/tests": tests, "/logs/verifier": logs}
    if getattr(runtime, "persistent", False) and uses_uv(spec) and (uv := await ensure_uv()) is not None:
        # uv where TB 2.0's installer puts it, put there again after the agent's run (uvtool.py)
        mounts[f"{runtime.home_view(home)}/.local/bin"] = uv
    res = await _verify(runtime, ExecSpec(
        argv=["/bin/bash", "-c", spec.command or "bash /tests/test.sh"], env={**command_env(runtime, home), **spec.env},
        workspace=copy,
        home=home, limits=Limits(timeout_s=spec.timeout_s), network=spec.network, log_path=log_path,
        mount=task.workspace.mount or "/app", mounts=mounts))
    if isinstance(res, EvalResult):
        timed_out = "verifier_timeout" in res.metrics
        return _unless_fault(res, _log_text(log_path, ""), logs, timed_out) if timed_out else res
    metrics = {"eval_exit_code": float(res.returncode or 0)}
    try:
        written = reward_file(logs)
    except ValueError as e:
        return EvalResult(None, metrics, error=f"verifier: {e}", detail=res.output_tail[-500:])
    if written is None:
        result = EvalResult(1.0 if res.returncode == 0 else 0.0, metrics, detail=res.output_tail[-500:])
    else:
        result = EvalResult(written, {**metrics, "reward_file": 1.0}, detail=res.output_tail[-500:])
    return _unless_fault(result, _log_text(log_path, res.output_tail), logs) if result.reward == 0.0 else result


def _unless_fault(result: EvalResult, log: str, logs: Path, timed_out: bool = False) -> EvalResult:
    """``result`` (a 0), or an infrastructure error when the verifier's output shows it never judged."""
    fault = classify(log, timed_out=timed_out, reported=(logs / "ctrf.json").is_file())
    if fault is None:
        return result
    return EvalResult(None, {**result.metrics, "verifier_fault": 1.0}, error=fault.summary(), detail=result.detail, fault=fault)


LOG_READ_BYTES = 512 * 1024  # an apt-and-pip prelude's output fits; a runaway log is read from its end


def _log_text(log_path: Path | None, fallback: str) -> str:
    """The verifier's whole output (its last LOG_READ_BYTES), else what the run kept of it."""
    if log_path is None or not log_path.is_file():
        return fallback
    with open(log_path, "rb") as f:
        f.seek(max(0, log_path.stat().st_size - LOG_READ_BYTES))
        return f.read().decode(errors="replace")


def write_tree(root: Path, files: dict[str, str]) -> None:
    """Write relative path -> content under ``root`` (scripts executable); a path leaving it is refused."""
    for rel, content in files.items():
        path = (root / rel).resolve()
        if rel.startswith("/") or not path.is_relative_to(root.resolve()):
            raise ValueError(f"{rel!r} escapes the tests directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        if path.suffix in (".sh", ".py", ".bash"):
            path.chmod(0o755)


def reward_file(logs: Path) -> float | None:
    """The verifier's reward from ``reward.txt`` (read first) or ``reward.json``, clamped to [0, 1]; None
    when it wrote neither; ValueError when what it wrote is not a reward."""
    txt, js = logs / "reward.txt", logs / "reward.json"
    if txt.is_file():
        try:
            value = float(txt.read_text().strip())
        except ValueError:
            raise ValueError(f"reward.txt is not one number: {txt.read_text()[:80]!r}") from None
    elif js.is_file():
        try:
            data = json.loads(js.read_text())
            numbers = [float(v) for v in data.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
            value = float(data["reward"]) if "reward" in data else sum(numbers) / len(numbers)
        except (ValueError, TypeError, AttributeError, KeyError, ZeroDivisionError):
            raise ValueError(f"reward.json has no reward and no numbers: {js.read_text()[:80]!r}") from None
    else:
        return None
    if value != value:  # NaN
        raise ValueError("the reward is NaN")
    return min(1.0, max(0.0, value))


_PY_DRIVER = """
import importlib, json, sys
from schemas import TaskRequest
mod, _, fn = sys.argv[1].partition(":")
task = TaskRequest.model_validate_json(sys.stdin.read())
out = getattr(importlib.import_module(mod), fn)(sys.argv[2], task)
print("\\n" + json.dumps(out if isinstance(out, dict) else {"reward": out}))
"""


def _python_env() -> dict[str, str]:
    # The callable's module is resolved as from the node's working directory (where its config lives).
    paths = [os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH", "")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


async def run_python(spec: EvaluatorSpec, copy: Path, task: TaskRequest, cwd: Path) -> EvalResult:
    """Call ``module:function`` in a child interpreter of the node's Python (the evaluator is trusted)."""
    if ":" not in spec.callable:
        return EvalResult(None, error=f"evaluator.callable: {spec.callable!r} is not 'module:function'")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _PY_DRIVER, spec.callable, str(copy), cwd=str(cwd), env=_python_env(), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(task.model_dump_json().encode()), spec.timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return EvalResult(0.0, {"verifier_timeout": 1.0}, detail=f"evaluator timed out after {spec.timeout_s}s")
    if proc.returncode != 0:
        return EvalResult(None, error=f"evaluator {spec.callable} failed: {err.decode(errors='replace').strip()[-500:]}")
    try:
        result = json.loads(out.decode().strip().splitlines()[-1])
        reward = float(result["reward"])
        metrics = {str(k): float(v) for k, v in (result.get("metrics") or {}).items()}
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        return EvalResult(None, error=f"evaluator {spec.callable} returned no usable reward ({e!r})")
    return EvalResult(reward, metrics)


async def evaluate(spec: EvaluatorSpec, workspace: Path, scratch: Path, task: TaskRequest, runtime: Runtime,
                   log_path: Path | None = None) -> EvalResult:
    """Evaluate ``workspace`` per ``spec`` on a fresh copy under ``scratch``; never raises for evaluator faults."""
    if spec.kind == "none":
        return EvalResult(None, detail="no evaluator")
    stop = getattr(runtime, "stop_processes", None)
    if stop is not None and spec.agent_processes == "kill":
        try:
            await stop()
        except RuntimeUnavailable as e:
            return EvalResult(None, error=f"evaluator runtime: {e}")
    try:
        if not getattr(runtime, "persistent", False):
            copy = fresh_copy(workspace, scratch / "eval-workspace")
        elif spec.kind in ("files", "python"):
            copy = await runtime.export_workspace(scratch / "eval-workspace")
        else:
            copy = workspace  # unused: the verifier runs in the container's own workspace
    except (OSError, RuntimeUnavailable) as e:
        return EvalResult(None, error=f"cannot copy the workspace for evaluation: {e}")
    home = scratch / "eval-home"
    home.mkdir(parents=True, exist_ok=True)
    if spec.kind == "files":
        return score_files(copy, spec.expected_files)
    if spec.kind == "command":
        return await run_command(spec, copy, home, runtime, log_path)
    if spec.kind == "harbor":
        return await run_harbor(spec, copy, home, scratch, task, runtime, log_path)
    return await run_python(spec, copy, task, scratch)
