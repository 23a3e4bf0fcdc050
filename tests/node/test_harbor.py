"""Harbor tasks without Docker: the verifier runs under bwrap with the workspace at the task's working
dir, tests/ at /tests and a writable /logs/verifier; the reward file wins over the exit code."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.evaluators import evaluate
from gateway.node.oracle import check_task
from gateway.runtimes import BwrapRuntime, SubprocessRuntime
from producers.tasks import load_tasks
from schemas import EvaluatorSpec, TaskRequest, WorkspaceSpec
from tests.node.test_sandbox import needs_bwrap

EXAMPLES = Path(__file__).parents[2] / "examples" / "coding"


@needs_bwrap
@pytest.mark.parametrize("task_dir", sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir()))
def test_each_example_scores_0_untouched_and_1_with_its_solution(tmp_path, task_dir):
    (task,) = load_tasks(EXAMPLES / task_dir)
    res = asyncio.run(check_task(task, BwrapRuntime(), tmp_path))
    assert res.untouched.reward == 0.0, res.untouched
    assert res.solved is not None and res.solved.reward == 1.0, res.solved
    # Terminal-Bench-shaped: the verifier exits 0 either way and the reward comes from reward.txt
    assert res.untouched.metrics == {"eval_exit_code": 0.0, "reward_file": 1.0} and res.ok


def _task(tmp_path: Path, test_sh: str, mount: str = "/app") -> tuple[TaskRequest, Path]:
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    (ws / "answer.txt").write_text("42\n")
    task = TaskRequest(task_id="t", instruction="x", workspace=WorkspaceSpec(kind="dir", source=str(ws), mount=mount),
                       evaluator=EvaluatorSpec(kind="harbor", command="bash /tests/test.sh", timeout_s=20,
                                               tests={"test.sh": test_sh, "helpers/check.sh": "grep -q 42 answer.txt\n"}))
    return task, ws


def _eval(tmp_path: Path, test_sh: str, runtime=None, mount: str = "/app"):
    task, ws = _task(tmp_path, test_sh, mount)
    return asyncio.run(evaluate(task.evaluator, ws, tmp_path / "scratch", task, runtime or BwrapRuntime()))


@needs_bwrap
@pytest.mark.parametrize("test_sh, reward, from_file", [
    ("echo 0.25 > /logs/verifier/reward.txt; exit 1", 0.25, True),  # the file wins over the exit code
    ('echo \'{"tests": 1, "lint": 0}\' > /logs/verifier/reward.json', 0.5, True),  # no "reward": the mean
    ('echo \'{"reward": 0.75, "n": 9}\' > /logs/verifier/reward.json', 0.75, True),
    ("echo 7 > /logs/verifier/reward.txt; echo 0 > /logs/verifier/reward.json", 1.0, True),  # txt first, clamped
    ("bash /tests/helpers/check.sh", 1.0, False),  # no file: exit 0 is 1
    ("exit 3", 0.0, False),
])
def test_the_reward_file_then_the_exit_code(tmp_path, test_sh, reward, from_file):
    res = _eval(tmp_path, test_sh)
    assert res.error == "" and res.reward == reward, res
    assert ("reward_file" in res.metrics) == from_file


@needs_bwrap
def test_the_verifier_sees_the_workspace_at_the_working_dir_and_tests_at_slash_tests(tmp_path):
    res = _eval(tmp_path, '[ "$PWD" = /srv/app ] && [ -f /srv/app/answer.txt ] && [ -f /tests/helpers/check.sh ] '
                          '&& [ ! -e /workspace/answer.txt ] && touch /logs/verifier/ok', mount="/srv/app")
    assert res.reward == 1.0, res


@needs_bwrap
def test_a_reward_file_that_is_not_a_reward_is_an_evaluator_error_not_a_zero(tmp_path):
    res = _eval(tmp_path, "echo lots > /logs/verifier/reward.txt")
    assert res.reward is None and "reward.txt is not one number" in res.error


@needs_bwrap
def test_a_verifier_past_its_timeout_is_masked_before_its_tests_start_and_scores_0_after(tmp_path):
    task, ws = _task(tmp_path, "echo 'Get:1 http://deb.debian.org/debian bookworm InRelease'; sleep 30")
    task.evaluator.timeout_s = 1
    res = asyncio.run(evaluate(task.evaluator, ws, tmp_path / "scratch", task, BwrapRuntime(), tmp_path / "eval.log"))
    assert res.reward is None and res.fault is not None and res.fault.cause == "timeout"  # stuck installing: not the agent's
    assert "bookworm InRelease" in res.fault.evidence[-1] and res.metrics["verifier_fault"] == 1.0
    started = tmp_path / "started"
    started.mkdir()
    task, ws = _task(started, "echo '============================= test session starts =============================='; sleep 30")
    task.evaluator.timeout_s = 1
    res = asyncio.run(evaluate(task.evaluator, ws, started / "scratch", task, BwrapRuntime(), started / "eval.log"))
    assert res.reward == 0.0 and res.metrics == {"verifier_timeout": 1.0} and res.fault is None  # the agent's code hung


def test_the_subprocess_runtime_refuses_harbor_mounts_in_one_line(tmp_path):
    res = _eval(tmp_path, "exit 0", runtime=SubprocessRuntime())
    assert res.reward is None and "cannot show directories at /app, /tests, /logs/verifier" in res.error
