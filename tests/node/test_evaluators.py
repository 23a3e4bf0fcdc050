"""Evaluators score a fresh copy of the workspace; timeouts are recorded, broken evaluators masked."""

from __future__ import annotations

from pathlib import Path

from gateway.evaluators import evaluate
from gateway.runtimes import SubprocessRuntime
from schemas import EvaluatorSpec, TaskRequest

TASK = TaskRequest(task_id="t", instruction="x")


def _ws(tmp_path: Path, **files: str) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    for name, content in files.items():
        (ws / name).write_text(content)
    return ws


async def test_command_reward_and_fresh_copy(tmp_path):
    ws = _ws(tmp_path, **{"answer.txt": "42"})
    ok = EvaluatorSpec(kind="command", command="test \"$(cat answer.txt)\" = 42 && echo tampered > answer.txt")
    res = await evaluate(ok, ws, tmp_path / "scratch", TASK, SubprocessRuntime())
    assert res.reward == 1.0 and not res.error
    assert (ws / "answer.txt").read_text() == "42"  # the evaluator ran on a copy
    bad = EvaluatorSpec(kind="command", command="test \"$(cat answer.txt)\" = 41")
    assert (await evaluate(bad, ws, tmp_path / "scratch2", TASK, SubprocessRuntime())).reward == 0.0


async def test_command_timeout_is_recorded_not_raised(tmp_path):
    ws = _ws(tmp_path)
    res = await evaluate(EvaluatorSpec(kind="command", command="sleep 30", timeout_s=0.5), ws, tmp_path / "s", TASK, SubprocessRuntime())
    assert res.reward == 0.0 and res.metrics["verifier_timeout"] == 1.0 and not res.error


async def test_expected_files_fraction(tmp_path):
    ws = _ws(tmp_path, a="1", b="wrong")
    spec = EvaluatorSpec(kind="files", expected_files={"a": "1", "b": "2", "c": "3", "../escape": "x"})
    res = await evaluate(spec, ws, tmp_path / "s", TASK, SubprocessRuntime())
    assert res.error == "evaluator.expected_files: '../escape' points outside the workspace" and res.reward is None
    spec = EvaluatorSpec(kind="files", expected_files={"a": "1", "b": "2"})
    res = await evaluate(spec, ws, tmp_path / "s2", TASK, SubprocessRuntime())
    assert res.reward == 0.5 and res.metrics == {"files_matched": 1.0, "files_expected": 2.0}


async def test_python_callable(tmp_path, monkeypatch):
    mod = tmp_path / "mods"
    mod.mkdir()
    (mod / "my_eval.py").write_text(
        "import pathlib, time\n"
        "def score(ws, task):\n    return {'reward': float(pathlib.Path(ws, 'a').read_text()), 'metrics': {'n': len(task.task_id)}}\n"
        "def plain(ws, task):\n    return 0.25\n"
        "def crash(ws, task):\n    raise RuntimeError('grader bug')\n"
        "def hang(ws, task):\n    time.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", str(mod))
    ws = _ws(tmp_path, a="0.75")
    run = lambda fn, **kw: evaluate(EvaluatorSpec(kind="python", callable=f"my_eval:{fn}", **kw), ws, tmp_path / fn, TASK, SubprocessRuntime())
    res = await run("score")
    assert (res.reward, res.metrics, res.error) == (0.75, {"n": 1.0}, "")
    assert (await run("plain")).reward == 0.25
    crashed = await run("crash")
    assert crashed.reward is None and "grader bug" in crashed.error  # infrastructure failure: masked, not a 0
    hung = await run("hang", timeout_s=1.0)
    assert hung.reward == 0.0 and hung.metrics == {"verifier_timeout": 1.0}
    bad = await evaluate(EvaluatorSpec(kind="python", callable="no_colon"), ws, tmp_path / "b", TASK, SubprocessRuntime())
    assert "is not 'module:function'" in bad.error


async def test_none_evaluator(tmp_path):
    res = await evaluate(EvaluatorSpec(kind="none"), _ws(tmp_path), tmp_path / "s", TASK, SubprocessRuntime())
    assert res.reward is None and not res.error
