"""Apptainer is absent here, so its generated command line is what we check; podman's exec line too (the
containers themselves run in tests/node/test_podman.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.runtimes import ApptainerRuntime, ContainerRuntime, ContainerSandbox, ExecSpec, Limits, RuntimeUnavailable, make_runtime
from gateway.runtimes.bwrap import TUNNEL


def spec(tmp_path: Path, env: dict | None = None, **kw) -> ExecSpec:
    return ExecSpec(argv=["agent", "--go"], env=env or {"B": "2", "A": "1"}, workspace=tmp_path / "ws", home=tmp_path / "home",
                    limits=Limits(memory_mb=2048, cpu_s=600, nofile=1024, timeout_s=30), gateway_port=8100,
                    ro_paths=[Path("/cache/npm/pi")], **kw)


def test_apptainer_exec_line(tmp_path):
    rt = ApptainerRuntime("docker://python:3.11", tmp_path / "gw.sock", apptainer="/usr/bin/apptainer")
    cmd = rt.command(spec(tmp_path))
    assert cmd[:5] == ["/usr/bin/prlimit", "--cpu=600", f"--as={2048 * 2**20}", "--nofile=1024", "--"]
    rest = cmd[5:]
    assert rest[:7] == ["/usr/bin/apptainer", "exec", "--containall", "--cleanenv", "--no-home", "--pwd", "/workspace"]
    binds = rest[rest.index("--bind") + 1].split(",")
    assert f"{tmp_path}/ws:/workspace" in binds and "/cache/npm/pi:/cache/npm/pi:ro" in binds
    assert f"{tmp_path}/gw.sock:/run/polar/gateway.sock" in binds
    assert rest[rest.index("--net"):rest.index("--net") + 3] == ["--net", "--network", "none"]
    assert rest[rest.index("docker://python:3.11") + 1:][-2:] == ["agent", "--go"]


def test_privileged_gateway_port_is_moved_inside(tmp_path):
    # uid 1000 in a sandbox cannot bind port 80: the tunnel listens on 10080 and the harness is told so
    rt = ApptainerRuntime("img", tmp_path / "gw.sock")
    s = spec(tmp_path)
    s.gateway_port = 80
    cmd = rt.command(s)
    assert cmd[cmd.index("--listen") + 1] == "127.0.0.1:10080" and rt.gateway_url(80) == "http://127.0.0.1:10080"
    box = ContainerSandbox(ContainerRuntime(tmp_path / "gw.sock"), "polar-x", "img", "/app", tmp_path, 0.0)
    assert box.gateway_url(80) == "http://127.0.0.1:10080" and box.gateway_url(8100) == "http://127.0.0.1:8100"


def test_podman_exec_line_keeps_the_images_path_behind_the_runs(tmp_path):
    box = ContainerSandbox(ContainerRuntime(tmp_path / "gw.sock"), "polar-x", "img", "/app", tmp_path, 0.0)
    box.image_path = "/opt/venv/bin:/usr/bin:/bin"
    cmd = box.command(spec(tmp_path, env={"PATH": "/cache/npm/pi/bin:/usr/bin:/bin", "A": "1"}))
    at = cmd.index("exec")
    assert cmd[at:at + 3] == ["exec", "-w", "/app"] and cmd[-3:] == ["polar-x", "agent", "--go"]
    assert "PATH=/cache/npm/pi/bin:/usr/bin:/bin:/opt/venv/bin" in cmd and "A=1" in cmd
    assert box.command(spec(tmp_path, mount="/srv"))[at + 2] == "/srv"


async def test_absent_engines_fail_clearly(tmp_path):
    from schemas import TaskRequest

    task = TaskRequest(task_id="t", instruction="x", workspace={"kind": "image"}, environment={"image": "img"})
    with pytest.raises(RuntimeUnavailable, match="/nonexistent/docker is not installed"):
        await ContainerRuntime(tmp_path / "gw.sock", engine="/nonexistent/docker").open(task, tmp_path)
    with pytest.raises(RuntimeUnavailable, match="apptainer: neither"):
        await ApptainerRuntime("img", tmp_path / "gw.sock", apptainer="/nonexistent/apptainer").run(spec(tmp_path))
    with pytest.raises(ValueError, match="needs an image"):
        make_runtime("apptainer")
    with pytest.raises(ValueError, match="unknown runtime 'k8s'"):
        make_runtime("k8s")
