"""The stage pipeline on real processes (subprocess runtime), events collected in order."""

from __future__ import annotations

import asyncio
import time

from gateway.node.config import NodeConfig
from gateway.node.pipeline import Pipeline, PrioritySlots
from gateway.node.session import Job
from gateway.runtimes import SubprocessRuntime
from schemas import EvaluatorSpec, HarnessSpec, SessionAssigned, TaskRequest, Timeouts, WorkspaceSpec


def job(i: int, *, command: list[str], prepare: list[str] = (), agent_s: float = 30, evaluator: EvaluatorSpec | None = None,
        task_id: str = "t", priority: int = 0) -> Job:
    task = TaskRequest(task_id=task_id, instruction="do", num_samples=8, min_valid=1, priority=priority,
                       workspace=WorkspaceSpec(kind="files", files={"in.txt": f"{i}"}), prepare=list(prepare),
                       harness=HarnessSpec(name="command", command=command),
                       evaluator=evaluator or EvaluatorSpec(kind="command", command="test -f out.txt"),
                       timeouts=Timeouts(init_s=30, agent_s=agent_s, eval_s=10))
    a = SessionAssigned(session_id=f"{task_id}.s{i}", group_id=task_id, task_id=task_id, sample_index=i, session_key="k", task=task)
    return Job(assigned=a, attempt=0, key="k")


def pipeline(tmp_path, events: list, **kw) -> Pipeline:
    cfg = NodeConfig(work_dir=tmp_path, cache_dir=tmp_path, runtime="subprocess", node_id="n1", **kw)

    async def publish(ev):
        events.append(ev)

    async def settle(run_id):
        return 0

    return Pipeline(cfg, SubprocessRuntime(), 1, publish, settle)


def by_session(events) -> dict[str, list[tuple]]:
    out: dict[str, list[tuple]] = {}
    for e in events:
        out.setdefault(e.session_id, []).append((e.kind, e.status, e.reward))
    return out


async def test_lifecycle_events_rewards_and_statuses(tmp_path):
    events: list = []
    p = pipeline(tmp_path, events, run_workers=2, ready_target=1, prepare_attempts=2)
    p.admit(job(0, command=["sh", "-c", "cp in.txt out.txt"]))
    p.admit(job(1, command=["sh", "-c", "exit 3"]))
    p.admit(job(2, command=["sleep", "30"], agent_s=0.5))
    p.admit(job(3, command=["sh", "-c", "touch out.txt"], prepare=["exit 1"]))
    await p.drain()
    got = by_session(events)
    assert got["t.s0"] == [("started", None, None), ("harness_exited", "ok", None), ("evaluated", None, 1.0), ("finished", "ok", 1.0)]
    assert got["t.s1"][-1] == ("finished", "failed", None)
    assert got["t.s2"][1:] == [("harness_exited", "timeout", None), ("finished", "timeout", 0.0)]
    assert got["t.s3"] == [("finished", "infra_error", None)]  # prepare kept failing: masked, never ran
    fin = {e.session_id: e for e in events if e.kind == "finished"}
    assert fin["t.s3"].detail.endswith("failed after 2 attempts (exit code 1): ")
    assert fin["t.s0"].num_calls == 0 and fin["t.s0"].metrics["exit_code"] == 0.0
    assert not list((tmp_path / "sessions").iterdir())  # torn down
    assert p.admitted == 0 and p.stats()["finished.ok"] == 1.0


async def test_ready_buffer_prepares_ahead_and_init_never_holds_a_run_slot(tmp_path):
    events: list = []
    p = pipeline(tmp_path, events, run_workers=1, ready_target=2, init_workers=3)
    jobs = [job(i, command=["sleep", "0.6"], prepare=["sleep 0.6"], evaluator=EvaluatorSpec(kind="none")) for i in range(3)]
    t0 = time.monotonic()
    for j in jobs:
        p.admit(j)
    await asyncio.sleep(0.3)
    assert p.stage["init"] == 3  # all three prepare at once while nothing runs yet
    await p.drain()
    wall = time.monotonic() - t0
    # INIT overlaps: one 0.6 s INIT, then three 0.6 s runs back to back (~2.4 s), not 3 x 1.2 s serial
    assert wall < 3.3, wall
    waits = [e.metrics["ready_wait_s"] for e in events if e.kind == "started"]
    assert max(waits) > 0.9  # the last prepared session waited in READY for two runs


async def test_cancel_in_every_stage(tmp_path):
    events: list = []
    p = pipeline(tmp_path, events, run_workers=1, ready_target=1, init_workers=1)
    running = job(0, command=["sleep", "30"])
    ready = job(1, command=["sleep", "30"])
    for j in (running, ready):
        p.admit(j)
    for _ in range(100):
        if p.stage["run"] == 1 and p.stage["ready"] == 1:
            break
        await asyncio.sleep(0.05)
    assert p.cancel_task("t", "early_stop") == 2
    await asyncio.wait_for(p.drain(), 10)
    fin = {e.session_id: e for e in events if e.kind == "finished"}
    assert fin["t.s0"].status == fin["t.s1"].status == "cancelled"
    assert fin["t.s0"].detail == "n1: early_stop"


async def test_priority_slots_serve_higher_priority_first():
    slots = PrioritySlots(1)
    await slots.acquire()
    order = []

    async def waiter(name, prio):
        await slots.acquire(prio)
        order.append(name)
        slots.release()

    tasks = [asyncio.ensure_future(waiter(n, p)) for n, p in (("low", 0), ("high", 9), ("mid", 5))]
    await asyncio.sleep(0.01)
    slots.release()
    await asyncio.gather(*tasks)
    assert order == ["high", "mid", "low"] and slots.free == 1
