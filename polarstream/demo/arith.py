"""The demo's task family: every single-digit sum, split into train and held-out problems.

Each task asks for a number written to ``answer.txt``; a test command in the workspace scores it, so the
reward is the outcome of a real test, not a string match inside our code. The split is fixed by a seed,
so a demo run is reproducible; RL sees only the train split, and the held-out split measures whether
what RL taught (use the tool) carries over to problems it never trained on.
"""

from __future__ import annotations

import json
import random
import shlex

from schemas import EvaluatorSpec, HarnessSpec, TaskRequest, Timeouts, WorkspaceSpec

ANSWER_FILE = "answer.txt"


def instruction(question: str, tool: str = "write_file") -> str:
    """The task as the harness is given it; ``tool`` names the harness's own file-writing tool."""
    return f"Compute {question} and write only the result to {ANSWER_FILE} using the {tool} tool."


def family() -> list[tuple[str, str]]:
    """All 81 sums a + b with a, b in 1..9, as (question, answer)."""
    return [(f"{a} + {b}", str(a + b)) for a in range(1, 10) for b in range(1, 10)]


def split(seed: int = 0, heldout: int = 16) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, held-out): ``heldout`` problems of the family drawn by ``seed``, the rest for training."""
    problems = family()
    random.Random(f"split-{seed}").shuffle(problems)
    return sorted(problems[heldout:]), sorted(problems[:heldout])


def _problem(question: str, answer: str, tool: str, agent_timeout_s: float) -> dict:
    """What every task of a problem holds: its instruction, workspace and evaluator (a shell test of answer.txt)."""
    test = f"test \"$(tr -d ' \\n' < {ANSWER_FILE} 2>/dev/null)\" = {shlex.quote(answer)}"
    return dict(
        instruction=instruction(question, tool),
        workspace=WorkspaceSpec(kind="files", files={"README.md": "Write your answer to answer.txt.\n"}),
        evaluator=EvaluatorSpec(kind="command", command=test, timeout_s=10.0),
        timeouts=Timeouts(init_s=60.0, agent_s=agent_timeout_s, eval_s=10.0),
        metadata={"question": question, "answer": answer},
    )


def template(question: str, answer: str, tool: str = "write_file", agent_timeout_s: float = 60.0) -> TaskRequest:
    """The problem as the driver takes a task (polarstream/driver/preset.py): its id is the question (which
    names it in the per-task figures and the curriculum), and it sets no group size, minimum or harness of
    its own, so the run's apply."""
    return TaskRequest(task_id=question, **_problem(question, answer, tool, agent_timeout_s))


def task_request(
    question: str,
    answer: str,
    *,
    task_id: str,
    num_samples: int,
    harness: HarnessSpec,
    agent_timeout_s: float = 60.0,
    task_set: str = "demo-arith",
    tool: str = "write_file",
) -> TaskRequest:
    """A whole TaskRequest for the problem (a task file's line, the capture's session): half its samples
    must be usable."""
    return TaskRequest(task_id=task_id, harness=harness, num_samples=num_samples, min_valid=max(1, num_samples // 2),
                       task_set=task_set, **_problem(question, answer, tool, agent_timeout_s))


def reward(text: str, answer: str, tool: str = "write_file", path_key: str = "path", roots: tuple[str, ...] = ("./",)) -> float:
    """1.0 when the completion writes exactly ``answer`` to answer.txt with ``tool`` (its path in
    ``path_key``, relative or under one of ``roots``), else 0.0."""
    from gateway.toolparse import parse_tool_calls

    for call in parse_tool_calls(text).tool_calls:
        try:
            args = json.loads(call.arguments) if isinstance(call.arguments, str) else call.arguments
        except ValueError:
            continue
        if call.name != tool or not isinstance(args, dict):
            continue
        path = str(args.get(path_key, ""))
        for root in roots:
            path = path.removeprefix(root)
        if path == ANSWER_FILE and str(args.get("content", "")).strip() == answer:
            return 1.0
    return 0.0
