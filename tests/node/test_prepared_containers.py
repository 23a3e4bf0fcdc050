"""Containers started ahead of need, on real podman: each serves one session and is removed with it, a
session's files never reach another's, a killed node's prepared containers go with its next start's
cleanup, and a verifier's files travel in one exec (with a fallback for an image without tar)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from gateway.runtimes import ContainerRuntime, ExecSpec, Limits
from gateway.runtimes.prepared import PreparedContainers, StartGate
from schemas import TaskRequest
from tests.node.test_podman import FETCH, fake_gateway

pytestmark = pytest.mark.integration

DOCKERFILE = "FROM debian:bookworm-slim\nWORKDIR /app\nRUN echo from-image > /app/f.txt\n"


def image_task(dockerfile: str = DOCKERFILE) -> TaskRequest:
    return TaskRequest(task_id="t", instruction="x", workspace={"kind": "image", "mount": "/app"},
                       environment={"context": {"Dockerfile": dockerfile}, "allow_internet": False},
                       evaluator={"kind": "harbor", "tests": {"test.sh": "true"}, "network": "none"})


def session_root(tmp_path: Path, i: int) -> Path:
    root = tmp_path / "sessions" / f"s{i}"
    for d in ("home", "workspace", "logs"):
        (root / d).mkdir(parents=True)
    return root


def spec(root: Path, argv: list[str], **kw) -> ExecSpec:
    return ExecSpec(argv=argv, env={"PATH": "/usr/bin:/bin"}, workspace=root / "workspace", home=root / "home",
                    limits=Limits(timeout_s=60), network="none", log_path=root / "logs" / "run.log", **kw)


def owned(owner: Path) -> set[str]:
    out = subprocess.run(["podman", "ps", "-a", "--filter", f"label=io.polarstream.owner={owner}", "--format",
                          "{{.Names}}"], capture_output=True, text=True, check=True).stdout
    return set(out.split())


async def until(cond, timeout_s: float = 90.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "timed out waiting"
        await asyncio.sleep(0.1)


async def test_a_prepared_container_serves_one_session_and_a_dead_nodes_are_removed(tmp_path, podman_base):
    server, relay, sock, port = await fake_gateway(tmp_path)
    rt = ContainerRuntime(sock, owner=str(tmp_path), prepared=2)
    task = image_task()
    first = await rt.open(task, session_root(tmp_path, 0))
    assert not first.was_prepared  # none was ready: opened on demand, and two more of its shape started
    await until(lambda: rt.prepared.ready() == 2)
    boxes = [first] + [await rt.open(task, session_root(tmp_path, i)) for i in (1, 2)]
    assert [b.was_prepared for b in boxes] == [False, True, True]
    try:
        # the session's HOME is its own directory, bound in the container it was given
        a, b = boxes[1], boxes[2]
        wrote = await a.run(spec(a.root, ["sh", "-c", "echo mine > /app/f.txt; echo cfg > /home/agent/h"]))
        seen = await b.run(spec(b.root, ["sh", "-c", "cat /app/f.txt; ls /home/agent"]))
        assert wrote.returncode == 0 and (a.root / "home" / "h").read_text() == "cfg\n"
        assert "from-image" in seen.output_tail and "mine" not in seen.output_tail and "h" not in seen.output_tail.split()
        # its gateway relay, started with it, opens for the harness run alone: not before, not after
        fetch = ["python3", "-c", FETCH.format(port=port)]
        before = await b.run(spec(b.root, fetch))
        during = await b.run(replace(spec(b.root, fetch), network="gateway", gateway_port=port))
        after = await b.run(spec(b.root, fetch))
        assert "unreachable" in before.output_tail and "hello-from-gateway" not in before.output_tail
        assert during.returncode == 0 and during.output_tail.count("hello-from-gateway") == 1
        assert after.output_tail.count("hello-from-gateway") == 1 and b.tunnel_ahead is None  # its run's line only
        # closing a session removes its container: the pool never gives it out again
        await a.close()
        assert a.cname not in owned(tmp_path) and not a.scratch.exists()
        given = [x.cname for x in boxes]
        for i in range(3, 7):
            await until(lambda: rt.prepared.ready() >= 1)
            box = await rt.open(task, session_root(tmp_path, i))
            boxes.append(box)
            given.append(box.cname)
            assert box.was_prepared
        assert len(given) == len(set(given)) == 7  # no container served two sessions
        await until(lambda: rt.prepared.ready() == 2)
        live = owned(tmp_path)
        assert set(given) - {a.cname} <= live and len(live) == 6 + 2  # the open sessions' and two prepared
    finally:
        # the node dies: its successor (same work dir) removes sessions' and prepared containers alike
        left = owned(tmp_path)
        assert await ContainerRuntime(None, owner=str(tmp_path)).cleanup() == len(left) > 0
        server.close()
        relay.close()
    assert owned(tmp_path) == set()


async def test_a_stopping_node_discards_its_prepared_containers(tmp_path, podman_base):
    rt = ContainerRuntime(None, owner=str(tmp_path), prepared=2)
    box = await rt.open(image_task(), session_root(tmp_path, 0))
    await until(lambda: rt.prepared.ready() == 2)
    await box.close()
    await rt.discard_prepared()
    assert owned(tmp_path) == set() and list((tmp_path / "sessions" / ".prepared").iterdir()) == []


async def test_a_verifier_s_files_go_in_and_come_back_in_one_exec_and_leftovers_are_killed_first(tmp_path, podman_base):
    rt = ContainerRuntime(None, owner=str(tmp_path))
    for i, dockerfile in enumerate((DOCKERFILE, DOCKERFILE + "RUN rm -f /usr/bin/tar /bin/tar\n")):  # 2nd: engine cp
        root = session_root(tmp_path, i)
        box = await rt.open(image_task(dockerfile), root)
        try:
            agent = await box.run(spec(root, ["sh", "-c", "sleep 1000 >/dev/null 2>&1 & echo started"]))
            assert agent.returncode == 0
            tests, logs = root / "tests", root / "logs-verifier"
            tests.mkdir()
            logs.mkdir()
            (tests / "test.sh").write_text("cat /tests/data.txt > /logs/verifier/seen.txt\n"
                                           "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done | grep -c '^sleep 1000' > /logs/verifier/sleeps.txt\n"
                                           "echo 1 > /logs/verifier/reward.txt\nexit 3\n")
            (tests / "data.txt").write_text("input-data")
            await box.stop_processes()
            res = await box.run(spec(root, ["bash", "/tests/test.sh"], mount="/app",
                                     mounts={"/tests": tests, "/logs/verifier": logs}))
            assert res.returncode == 3 and not res.timed_out
            assert ("verify_exec_s" in box.parts) == (i == 0)  # one exec where the image has tar, else engine cp
            assert bool(box.runc_id) == bool(shutil.which("runc"))  # runs go through runc's exec where podman uses runc
            assert (logs / "reward.txt").read_text() == "1\n" and (logs / "seen.txt").read_text() == "input-data"
            assert (logs / "sleeps.txt").read_text().strip() == "0"  # the agent's sleep was gone before the verifier
        finally:
            await box.close()
    assert owned(tmp_path) == set()


async def test_the_start_gate_caps_starts_at_once_and_their_rate():
    async def starts(gate: StartGate, n: int, hold: float) -> list[float]:
        began: list[float] = []

        async def start():
            async with gate.start():
                began.append(time.monotonic())
                await asyncio.sleep(hold)

        await asyncio.gather(*(start() for _ in range(n)))
        return sorted(began)

    at_once = StartGate(max_starting=2, starts_per_s=1000.0)
    await starts(at_once, 8, 0.05)
    assert at_once.peak == 2 and at_once.starting == 0
    paced = await starts(StartGate(max_starting=8, starts_per_s=20.0), 8, 0.0)
    assert paced[-1] - paced[0] >= 7 * 0.05 - 0.02  # 8 starts at 20 a second: 0.35 s from first to last
    with pytest.raises(ValueError):
        StartGate(max_starting=0)


async def test_a_start_ahead_of_need_waits_for_the_starts_sessions_wait_for():
    gate, order = StartGate(max_starting=4, starts_per_s=1000.0), []

    async def start(name: str, ahead: bool, hold: float):
        async with gate.start(ahead):
            order.append(name)
            await asyncio.sleep(hold)
        order.append(f"{name} done")

    needed = asyncio.ensure_future(start("needed", False, 0.2))
    await asyncio.sleep(0.01)
    await asyncio.gather(start("ahead", True, 0.0), needed)
    assert order == ["needed", "needed done", "ahead", "ahead done"]  # a free slot, but a session waited


async def test_the_pool_gives_each_container_once_and_removes_those_left_idle():
    made, removed = [], []

    async def start(shape):
        made.append(object())
        return made[-1]

    async def remove(box):
        removed.append(box)

    pool = PreparedContainers(start, remove, per_shape=2, max_idle_s=0.3)
    pool.want("a")
    pool.want("a")  # already starting: no more than per_shape
    await until(lambda: pool.ready("a") == 2, 5)
    first, second = pool.take("a"), pool.take("a")
    assert first is not second and pool.take("a") is None and pool.take("b") is None and len(made) == 2
    pool.want("a")
    await until(lambda: pool.ready("a") == 2, 5)
    await until(lambda: len(removed) == 2, 5)  # nobody took them: removed, never handed out
    assert pool.ready() == 0 and first not in removed and second not in removed and pool.take("a") is None
