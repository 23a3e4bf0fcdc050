"""Image tasks on a real gateway node under the container runtimes (issue 62), with Kafka (the harness is
the `command` one, which calls no model: no engine runs).

- Isolation: the bwrap escape probes again, in a session's container: no host file outside its mounts
  (the host's /etc/shadow, a secret in the node's work dir, the repository, the npm cache in $HOME), no
  host process, no network but the gateway (the Kafka broker's and the storage server's host ports are
  unreachable, and so are other addresses and DNS with allow_internet false); and a task's memory_mb
  enforced: a harness past it is killed, and the session ends "failed" with "out of memory", no reward.
- Faults: a node SIGKILLed mid-session leaves its container running; the node restarted on the same work
  dir removes it, and the session is re-run once (attempt 1), never twice. A node stopped without draining
  removes the containers of its sessions in RUN and in READY; any starting node removes those of a dead
  node of another work dir (by default each node id has its own).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from gateway.config import GatewayConfig
from gateway.node.config import NodeConfig
from gateway.node.node import Node
from gateway.runtimes.podman import OWNER_LABEL, SESSION_LABEL
from tests.rollout.helpers import session_events, submit, wait_assigned

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
# The image every container test of the suite shares (the same Dockerfile: one build, by content hash).
DOCKERFILE = "FROM debian:bookworm-slim\nWORKDIR /app\n"
NO_ENGINE = "http://127.0.0.1:9"  # the command harness calls no model: no engine to start


def image_task(task_id: str, command: list[str], memory_mb: int = 512, agent_s: float = 60, **fields) -> dict:
    return {"task_id": task_id, "instruction": "probe", "num_samples": 1, "min_valid": 1,
            "workspace": {"kind": "image", "mount": "/app"},
            "environment": {"context": {"Dockerfile": DOCKERFILE}, "memory_mb": memory_mb, "cpus": 1},
            "harness": {"name": "command", "command": command}, "evaluator": {"kind": "none"},
            "timeouts": {"agent_s": agent_s, "init_s": 60}, **fields}


def containers(owner: Path, *labels: str, all_states: bool = True) -> list[str]:
    """Names of the engine's containers of ``owner`` (a node's resolved work dir) with these labels too."""
    filters = [a for lab in (f"{OWNER_LABEL}={owner.resolve()}", *labels) for a in ("--filter", f"label={lab}")]
    out = subprocess.run(["podman", "ps", *(["-a"] if all_states else []), "--format", "{{.Names}}", *filters],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


PROBE = r"""
import hashlib, json, os, socket, sys, urllib.request
out = {}
def connect(host, port):
    s = socket.socket(); s.settimeout(2)
    try:
        return s.connect_ex((host, port))
    finally:
        s.close()
try:
    out["gateway"] = json.loads(urllib.request.urlopen(os.environ["POLAR_BASE_URL"] + "/health", timeout=10).read())["status"]
except Exception as e:
    out["gateway"] = repr(e)
out["ports"] = {p: connect("127.0.0.1", int(p)) for p in sys.argv[1].split(",")}
out["outside"] = connect("10.255.255.1", 80)
out["dns_server"] = connect("1.1.1.1", 53)
try:
    socket.getaddrinfo("example.com", 443); out["dns"] = "resolved"
except OSError as e:
    out["dns"] = type(e).__name__
out["files"] = {}
for path in sys.argv[2:]:
    try:
        data = open(path, "rb").read() if os.path.isfile(path) else None
        out["files"][path] = hashlib.sha256(data).hexdigest() if data is not None else sorted(os.listdir(path))
    except OSError as e:
        out["files"][path] = type(e).__name__
cmds = []
for pid in set(filter(str.isdigit, os.listdir("/proc"))) - {str(os.getpid())}:
    try:
        cmds.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace"))
    except OSError:
        pass
out["processes"] = cmds
out["cwd"] = os.getcwd()
print("PROBE " + json.dumps(out))
"""


async def test_a_container_session_reaches_only_the_gateway_sees_no_host_file_and_is_held_to_its_memory(
        polar_settings, tmp_path, podman_base, tiny_model_dir, rollout_server):
    work = tmp_path / "node"
    work.mkdir()
    secret = work / "secret.txt"  # e.g. the node's own files
    secret.write_text("do not read")
    host_files = {"/etc/shadow": hashlib.sha256(Path("/etc/shadow").read_bytes()).hexdigest(), str(secret): "",
                  str(REPO / "pyproject.toml"): "", str(Path.home() / ".cache" / "polarstream"): "", str(work): ""}
    kafka_port = polar_settings.kafka_bootstrap.rsplit(":", 1)[1]
    s3_port = polar_settings.s3_endpoint_url.rsplit(":", 1)[1].split("/")[0]
    cfg = NodeConfig(work_dir=work, cache_dir=tmp_path, runtime="auto", node_id="iso", run_workers=2, ready_target=1,
                     keep_workdirs=True)
    node = Node(polar_settings, cfg, GatewayConfig(engine_urls=[NO_ENGINE], model=str(tiny_model_dir)))
    tasks = [image_task("probe", ["python3", "-c", PROBE, f"{kafka_port},{s3_port}", *host_files]),
             image_task("oom", ["python3", "-c", "x = bytearray(400 * 2**20); print('allocated')"], memory_mb=128)]
    await node.start()
    try:
        async with httpx.AsyncClient(base_url=rollout_server.url) as client:
            for t in tasks:
                assert (await client.post("/tasks", json=t)).status_code == 202
            for _ in range(600):
                if sum([(await client.get(f"/tasks/{t['task_id']}")).json()["finished"] for t in tasks]) == len(tasks):
                    break
                await asyncio.sleep(0.1)
            # three sessions that would run for a minute: two in RUN, one prepared in READY, when the node
            # stops without draining; none of their containers may stay
            assert (await client.post("/tasks", json=image_task("held", ["sleep", "60"], num_samples=3))).status_code == 202
            for _ in range(600):
                if node.pipeline.stage["run"] == 2 and node.pipeline.stage["ready"] == 1:
                    break
                await asyncio.sleep(0.1)
            # each its own container, running (beside them, ones prepared for sessions to come: prepared.py)
            held = {j.sandbox.cname for j in node.pipeline.jobs.values() if j.task.task_id == "held" and j.sandbox}
            assert len(held) == 3 and held <= set(containers(work, all_states=False))
    finally:
        lifecycles = list(node.pipeline.tasks)
        await node.stop(drain=False)
        await asyncio.wait(lifecycles, timeout=30)
    assert containers(work) == []
    events = await asyncio.to_thread(session_events, polar_settings, until=lambda evs: {"probe", "oom"} <= {
        e.task_id for e in evs if e.kind == "finished"})
    fin = {e.task_id: e for e in events if e.kind == "finished" and e.task_id != "held"}
    assert set(fin) == {"probe", "oom"}, fin

    # the memory limit: killed, recognised, a failed session (not a reward of 0, not a timeout)
    oom = fin["oom"]
    assert (oom.status, oom.reward) == ("failed", None) and "out of memory (memory_mb=128)" in oom.detail, oom
    assert oom.metrics["oom_killed"] == 1.0 and oom.metrics["run_s"] < 30
    assert "allocated" not in (work / "sessions" / "oom.s0" / "logs" / "harness.log").read_text()

    assert fin["probe"].status == "ok", fin["probe"]
    log = (work / "sessions" / "probe.s0" / "logs" / "harness.log").read_text()
    out = json.loads(log.split("PROBE ", 1)[1])
    assert out["gateway"] == "ok", out  # through the tunnel, at the gateway's port on the container's own loopback
    assert out["ports"] == {kafka_port: 111, s3_port: 111}, out  # ECONNREFUSED: the loopback is the container's
    assert out["outside"] == 101 and out["dns_server"] == 101 and out["dns"] == "gaierror", out  # ENETUNREACH
    assert out["files"].pop("/etc/shadow") != host_files["/etc/shadow"], out  # the image's own, not the host's
    assert all(v == "FileNotFoundError" for v in out["files"].values()), out
    assert not any("pytest" in c or "polarstream" in c for c in out["processes"]), out["processes"]  # no host process
    assert out["cwd"] == "/app"
    assert containers(work) == []  # every session's container removed at teardown


def no_engine() -> ThreadingHTTPServer:
    """An engine URL for a node whose harness calls no model: `polarstream node` wants its port to answer,
    and the gateway asks it for its model once (a 404 at once, not a silent socket it would wait on)."""
    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def all_events(settings, until) -> list:
    """The session events once ``until`` holds and one more second has passed (they are keyed by session
    id, so an attempt's events and its re-run's come from different partitions, in no set order)."""
    from schemas import SessionEvent, decode
    from tests.streams.helpers import dedupe, read_topic

    msgs = read_topic(settings, "session-events", timeout=30, idle=1.0,
                      until=lambda ms: until([decode(m.value, SessionEvent) for m in ms]))
    seen, _ = dedupe(msgs, SessionEvent)
    return [decode(v, SessionEvent) for v in seen.values()]


def test_a_killed_node_leaves_a_container_its_restart_removes_and_the_session_reruns_once(
        polar_settings, tmp_path, podman_base, tiny_model_dir, rollout_server, node_factory):
    stub = no_engine()
    node = node_factory(f"http://127.0.0.1:{stub.server_port}", tiny_model_dir, node_id="pk", runtime="auto", run_workers=1,
                        ready_target=1)
    node.wait_ready()
    wait_assigned(node)
    work = tmp_path / "pk"  # start_node's work dir for node "pk"
    # attempt 0 sleeps (mid-run when its node dies); the re-run (session id "<id>.a1") writes the answer
    rerun_or_sleep = "case $POLAR_SESSION_ID in *.a*) echo 7 > answer.txt ;; *) sleep 120 ;; esac"
    submit(rollout_server.url, image_task("kill", ["/bin/sh", "-c", rerun_or_sleep], agent_s=60,
                                          evaluator={"kind": "command", "command": 'test "$(cat answer.txt)" = 7'}))
    session_events(polar_settings, timeout=90, until=lambda evs: any(e.kind == "started" for e in evs))
    assert len(containers(work, f"{SESSION_LABEL}=kill.s0", all_states=False)) == 1
    node.kill()  # SIGKILL: no drain, no teardown; its container outlives it

    # The node restarted on the same work dir (in this process: a node process takes seconds to boot).
    cfg = NodeConfig(work_dir=work, cache_dir=tmp_path, runtime="auto", node_id="pk", run_workers=1, ready_target=1)
    again = Node(polar_settings, cfg, GatewayConfig(engine_urls=[NO_ENGINE], model=str(tiny_model_dir)),
                 session_timeout_ms=6000)

    async def restart() -> list:
        await again.start()
        try:
            left = containers(work, f"{SESSION_LABEL}=kill.s0")  # removed before any session is taken
            events = await asyncio.to_thread(all_events, polar_settings, lambda evs: any(e.kind == "finished" for e in evs)
                                             and sum(e.kind == "started" for e in evs) >= 2)
        finally:
            await again.stop(drain=True)
        return left, events

    left, events = asyncio.run(restart())
    stub.shutdown()
    assert left == []  # the dead attempt's container is gone
    fin = [e for e in events if e.kind == "finished"]
    assert [(e.attempt, e.session_id, e.status, e.reward) for e in fin] == [(1, "kill.s0.a1", "ok", 1.0)], fin
    assert sorted(e.attempt for e in events if e.kind == "started") == [0, 1]  # ran twice in all: re-run once
    lost = [e for e in events if e.kind == "harness_exited" and "node lost" in e.detail]
    assert [(e.attempt, e.status) for e in lost] == [(0, "infra_error")]
    assert containers(work) == []  # and the re-run's container went with its session


async def test_any_node_removes_the_containers_of_a_dead_node_of_another_work_dir(tmp_path, podman_base, monkeypatch):
    """A node started without --node-id gets a new work dir each time, so its successor would never
    find its containers by owner: every node also removes those whose node process is gone."""
    from gateway.runtimes import ContainerRuntime, podman
    from schemas import TaskRequest

    task = TaskRequest.model_validate(image_task("orphan", ["true"]))
    gone = subprocess.Popen(["true"])
    gone.wait()
    boot, pidns, _ = podman.owner_process().split(":")
    monkeypatch.setattr(podman, "owner_process", lambda: f"{boot}:{pidns}:{gone.pid}")  # made by a process now dead
    orphan = await ContainerRuntime(None, owner=str(tmp_path / "dead")).open(task, tmp_path / "s-dead")
    monkeypatch.undo()
    live = await ContainerRuntime(None, owner=str(tmp_path / "live")).open(task, tmp_path / "s-live")  # this process's
    try:
        assert await ContainerRuntime(None, owner=str(tmp_path / "new")).cleanup() == 0  # by owner only
        assert containers(tmp_path / "dead") == [orphan.cname]
        await ContainerRuntime(None, owner=str(tmp_path / "new")).cleanup(orphans=True)  # as a starting node does
        assert containers(tmp_path / "dead") == [] and containers(tmp_path / "live") == [live.cname]
    finally:
        await live.close()
        await orphan.close()
