"""Tasks through the whole rollout path on one cluster: the rollout server, two gateway nodes (bwrap
sandboxes, separate processes), real harness CLIs, the scripted engine and the stream processors, each
task ending as one TrainingGroup on polar.groups. The cluster is shared by the module (see
tests/plugins/rollout.py); the failover test kills a node, so it runs last.
"""

from __future__ import annotations

import pytest

from .helpers import session_events, submit, wait_assigned, wait_group

pytestmark = pytest.mark.integration

EVAL = {"kind": "command", "command": "test \"$(cat answer.txt)\" = 7"}


def run_task(cluster, task_id: str, harness: dict, instruction: str = "Write the number 7 to answer.txt.", timeout: float = 300):
    wait_assigned(*cluster.nodes.values())
    task = {"task_id": task_id, "instruction": instruction, "num_samples": 4, "min_valid": 2, "harness": harness,
            "evaluator": EVAL, "timeouts": {"agent_s": 180}}
    out = submit(cluster.rollout.url, task)
    assert out["sessions"] == [f"{task_id}.s{i}" for i in range(4)]
    return wait_group(cluster.settings, task_id, timeout=timeout)


def finished_events(cluster, task_id: str):
    return [e for e in session_events(cluster.settings) if e.kind == "finished" and e.task_id == task_id]


def mix(*specs: dict) -> dict:
    return {"name": "mix", "config": {"harnesses": list(specs)}}


@pytest.mark.harness
def test_two_real_clis_in_one_group_of_four(cluster, harness_cache):
    """pi (Anthropic Messages) and opencode (Chat Completions) in one GRPO group, across both nodes."""
    group = run_task(cluster, "clis-a", mix({"name": "pi", "config": {"api": "anthropic"}}, {"name": "opencode"}))
    assert len(group.trajectories) == 4 and group.masked == []
    assert sorted(t.harness for t in group.trajectories) == ["opencode", "opencode", "pi", "pi"]
    assert all(t.status == "ok" and t.reward == 1.0 and t.stats["trainable_tokens"] > 0 for t in group.trajectories)
    finished = finished_events(cluster, "clis-a")
    assert {e.detail.split(":")[0] for e in finished} == {"n1", "n2"}  # both nodes ran sessions
    assert all(e.num_calls >= 2 for e in finished)  # tool call + final answer (opencode adds a title call)


def test_killed_node_sessions_rerun_elsewhere(cluster):
    """SIGKILL a node mid-session: the other node re-runs its sessions as a new attempt; 4 valid members."""
    wait_assigned(*cluster.nodes.values())
    task = {"task_id": "failover", "instruction": "Slowly write 7 to answer.txt.", "num_samples": 4, "min_valid": 4,
            "harness": {"name": "builtin"}, "evaluator": EVAL, "timeouts": {"agent_s": 90}}
    submit(cluster.rollout.url, task)

    def running(evs):
        return any(e.kind == "started" and e.task_id == "failover" for e in evs)

    started = [e for e in session_events(cluster.settings, timeout=90, until=running) if e.kind == "started" and e.task_id == "failover"]
    victim = started[0].detail.split(";")[0]
    survivor = next(n for n in cluster.nodes if n != victim)
    cluster.nodes[victim].kill()  # no drain, no commit; its sandboxes die with it (--die-with-parent)

    group = wait_group(cluster.settings, "failover", timeout=240)
    assert len(group.trajectories) == 4 and group.masked == []
    assert all(t.status == "ok" and t.reward == 1.0 for t in group.trajectories)
    rerun = [t for t in group.trajectories if t.attempt > 0]
    assert rerun, "the killed node's sessions were not re-run"
    assert all(t.session_id == f"failover.s{t.sample_index}.a{t.attempt}" for t in rerun)

    events = [e for e in session_events(cluster.settings) if e.task_id == "failover"]
    lost = [e for e in events if e.kind == "harness_exited" and e.status == "infra_error" and "node lost" in e.detail]
    assert {(e.sample_index, e.attempt) for e in lost} == {(t.sample_index, t.attempt - 1) for t in rerun}
    finished = [e for e in events if e.kind == "finished"]
    assert sorted(e.sample_index for e in finished) == [0, 1, 2, 3]  # the dead attempts never claim an outcome
    assert {e.detail.split(":")[0] for e in finished if e.attempt > 0} == {survivor}
