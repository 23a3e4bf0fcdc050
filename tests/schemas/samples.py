"""One valid record of every type, with non-default values in the fields that matter."""

from __future__ import annotations

from schemas import (
    CallOutput, CallRecorded, ChainInfo, JudgeVerdict, PolicyVersion, PromptDelta, Record, SessionAssigned, SessionEvent,
    TaskRequest, TeacherScores, Timings, ToolCallOut, Trace, TrainingGroup, Trajectory, Usage, WorkspaceSpec,
)


def task(task_id: str = "task-1") -> TaskRequest:
    return TaskRequest(task_id=task_id, instruction="create hello.txt containing hi", num_samples=2, min_valid=1,
                       workspace=WorkspaceSpec(kind="files", files={"README.md": "# hi\n"}), prepare=["true"],
                       metadata={"difficulty": "easy", "tags": ["unicode ✓"]})


def call(session_id: str = "s-1", call_index: int = 0, delta: bool = False) -> CallRecorded:
    prompt = {"prompt_delta": PromptDelta(base_call_index=call_index - 1, base_len=5, suffix_ids=[7, 8])} if delta \
        else {"prompt_ids": [1, 2, 3, 4, 5]}
    return CallRecorded(
        session_id=session_id, group_id="task-1", task_id="task-1", sample_index=0, call_index=call_index,
        provider="openai.chat", model="polar-tiny", policy_version=3, harness="codex",
        request={"messages": [{"role": "user", "content": "hi"}], "tools": [], "temperature": 1.0},
        completion_ids=[10, 11, 12], completion_logprobs=[-0.5, -0.25, -1e-9], finish_reason="tool_calls",
        output=CallOutput(text="ok", tool_calls=[ToolCallOut(id="c1", name="shell", arguments='{"cmd": "ls"}')]),
        usage=Usage(prompt_tokens=5, completion_tokens=3), timings=Timings(received_at=1.5, upstream_ms=2.0, total_ms=3.0),
        chain=ChainInfo(extends_call_index=call_index - 1 if delta else None, break_reason="" if delta else "first_call"),
        **prompt,
    )


def trajectory(session_id: str = "s-1", reward: float = 1.0) -> Trajectory:
    trace = Trace(call_indices=[0], token_ids=[1, 2, 3, 10, 11], loss_mask=[0, 0, 0, 1, 1],
                  logprobs=[0.0, 0.0, 0.0, -0.5, -0.25], policy_versions=[3], break_reason="first_call")
    return Trajectory(session_id=session_id, group_id="task-1", task_id="task-1", num_samples=2, reward=reward,
                      traces=[trace], stats={"calls": 1.0, "traces": 1.0}, metrics={"tests_passed": 1.0})


def process_scored(session_id: str) -> Trajectory:
    """A trajectory whose trace carries per-token advantages (a judge's process scores; exact float64 ones too)."""
    t = trajectory(session_id, 1.0)
    trace = t.traces[0].model_copy(update={"token_advantages": [0.0, 0.0, 0.0, 1.04, 0.1 + 0.2]})
    return t.model_copy(update={"traces": [trace]})


def sample_records() -> list[Record]:
    """TaskRequest, SessionAssigned, CallRecorded (plain and delta), SessionEvent, Trajectory, TrainingGroup, PolicyVersion,
    JudgeVerdict, TeacherScores."""
    t = task()
    return [
        t,
        SessionAssigned(session_id="s-1", group_id="task-1", task_id="task-1", sample_index=0, session_key="k.sig", task=t),
        call("s-1", 0),
        call("s-1", 1, delta=True),
        SessionEvent(session_id="s-1", group_id="task-1", kind="finished", status="ok", reward=1.0, num_calls=2,
                     metrics={"turns": 2.0}),
        trajectory("s-1", 1.0),
        TrainingGroup(group_id="task-1", task_id="task-1", trajectories=[trajectory("s-1", 1.0), trajectory("s-2", 0.0)],
                      advantages=[1.0, -1.0], reward_mean=0.5, reward_std=0.5, policy_versions=[3]),
        TrainingGroup(group_id="task-2", task_id="task-2", trajectories=[process_scored("s-3"), trajectory("s-4", 0.0)],
                      advantages=[1.0, -1.0], masked=["s-5"], masked_reasons={"s-5": "judge:timeout"}),
        PolicyVersion(model="polar-tiny", version=4, checkpoint_url="s3://polarstream/ckpt/step-4", step=4, metrics={"loss": 0.1}),
        JudgeVerdict(group_id="task-1", session_id="s-1", trajectory_id="t-1", judge="j-1", model="rule", score=3.0,
                     chunk_scores=[3.0], detail="correct", attempts=2, prompt_tokens=40, completion_tokens=9),
        TeacherScores(group_id="task-1", group_event_id="g-ev", trajectory_id="t-ev", trace_index=0,
                      teacher="http://127.0.0.1:8001#teacher", step=5, positions=[4, 5], logprobs=[-0.25, -1.5]),
    ]
