"""The podman runtime on real containers: one container per session from the task's own image, the
gateway reachable only through the tunnel and only during a harness run, the memory limit enforced,
a timeout that kills the run, image builds cached by content and failing with the step that failed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.runtimes import ContainerRuntime, ExecSpec, ImageBuildError, Limits
from gateway.runtimes.images import ensure_image
from gateway.runtimes.tunnel import serve_unix_to_tcp
from schemas import EnvironmentSpec, TaskRequest

pytestmark = pytest.mark.integration

DOCKERFILE = "FROM debian:bookworm-slim\nWORKDIR /app\nRUN echo made-in-build > /app/f.txt\n"


def image_task(dockerfile: str = DOCKERFILE, **env) -> TaskRequest:
    return TaskRequest(task_id="t", instruction="x", workspace={"kind": "image", "mount": "/app"},
                       environment={"context": {"Dockerfile": dockerfile}, **env})


async def fake_gateway(tmp_path: Path):
    async def answer(reader, writer):
        await reader.read(100)
        writer.write(b"HTTP/1.0 200 OK\r\n\r\nhello-from-gateway")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sock = tmp_path / "gw.sock"
    relay = await serve_unix_to_tcp(str(sock), "127.0.0.1", port)
    return server, relay, sock, port


def run_spec(root: Path, argv: list[str], port: int, network: str = "gateway", timeout_s: float = 60) -> ExecSpec:
    return ExecSpec(argv=argv, env={"PATH": "/usr/bin:/bin"}, workspace=root / "workspace", home=root / "home",
                    limits=Limits(timeout_s=timeout_s), network=network, gateway_port=port, log_path=root / "run.log")


FETCH = "import urllib.request as u\ntry: print(u.urlopen('http://127.0.0.1:{port}', timeout=5).read().decode())\nexcept OSError as e: print('unreachable', type(e).__name__)"


async def test_a_session_container_sees_its_image_the_gateway_only_while_running_and_is_removed(tmp_path, podman_base):
    server, relay, sock, port = await fake_gateway(tmp_path)
    rt = ContainerRuntime(sock, owner=str(tmp_path))
    root = tmp_path / "s1"
    box = await rt.open(image_task(memory_mb=256), root, log_path=tmp_path / "build.log")
    try:
        fetch = FETCH.format(port=port)
        ran = await box.run(run_spec(root, ["python3", "-c", f"print(open('f.txt').read().strip())\n{fetch}"], port))
        assert ran.returncode == 0 and "made-in-build" in ran.output_tail and "hello-from-gateway" in ran.output_tail
        (root / "run.log").unlink()
        # the agent's change stays for the next run (the verifier sees the final state) ...
        wrote = await box.run(run_spec(root, ["sh", "-c", "echo changed > /app/f.txt"], port, network="none"))
        after = await box.run(run_spec(root, ["python3", "-c", f"print(open('f.txt').read().strip())\n{fetch}"], port, "none"))
        assert wrote.returncode == 0 and "changed" in after.output_tail
        assert "unreachable" in after.output_tail and "hello-from-gateway" not in after.output_tail  # no tunnel now
        # ... memory past the limit is killed and recognised as such
        oom = await box.run(run_spec(root, ["python3", "-c", "x = bytearray(600 * 2**20)"], port, "none"))
        assert oom.returncode != 0 and await box.oom_killed()
        # a run past its deadline is killed with the container
        slow = await box.run(run_spec(root, ["sleep", "60"], port, "none", timeout_s=2))
        assert slow.timed_out and slow.duration_s < 30 and box.dead
    finally:
        await box.close()
        server.close()
        relay.close()
    assert await rt.cleanup() == 0  # nothing of this owner left


async def test_a_node_that_died_leaves_containers_its_successor_removes(tmp_path, podman_base):
    rt = ContainerRuntime(None, owner=str(tmp_path))
    boxes = [await rt.open(image_task(), tmp_path / f"s{i}") for i in range(2)]
    assert all(not b.dead for b in boxes)
    again = await rt.open(image_task(), tmp_path / "s0")  # a session rerun in its root: the leftover is replaced
    assert again.cname == boxes[0].cname and again.pid and again.pid != boxes[0].pid
    assert await ContainerRuntime(None, owner=str(tmp_path)).cleanup() == 2  # a restarted node, same work dir
    assert await ContainerRuntime(None, owner=str(tmp_path)).cleanup() == 0


async def test_images_are_built_once_per_content_and_a_failed_build_names_its_step(tmp_path, podman_base):
    env = EnvironmentSpec(context={"Dockerfile": DOCKERFILE + f"RUN echo {tmp_path.name} > /id\n"})
    (tag, built_s), (again, cached_s) = await asyncio.gather(ensure_image(env), ensure_image(env))
    assert tag == again and tag.startswith("localhost/polar-task:")
    assert (await ensure_image(env))[1] == 0.0  # found, not built
    broken = EnvironmentSpec(context={"Dockerfile": "FROM debian:bookworm-slim\nRUN true\nRUN exit 3\nRUN true\n"})
    with pytest.raises(ImageBuildError, match=r"STEP 3/\d: RUN exit 3: .*exit status 3"):
        await ensure_image(broken)
    slow = EnvironmentSpec(context={"Dockerfile": "FROM debian:bookworm-slim\nRUN sleep 30\n"}, build_timeout_s=3)
    with pytest.raises(ImageBuildError, match=r"exceeded build_timeout_sec=3 at STEP 2/\d: RUN sleep 30"):
        await ensure_image(slow)
