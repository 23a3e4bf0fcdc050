"""Docker and Apptainer are absent here, so their generated command lines are what we check."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.runtimes import ApptainerRuntime, DockerRuntime, ExecSpec, Limits, RuntimeUnavailable, make_runtime
from gateway.runtimes.bwrap import TUNNEL


def spec(tmp_path: Path, **kw) -> ExecSpec:
    return ExecSpec(argv=["agent", "--go"], env={"B": "2", "A": "1"}, workspace=tmp_path / "ws", home=tmp_path / "home",
                    limits=Limits(memory_mb=2048, cpu_s=600, nofile=1024, timeout_s=30), gateway_port=8100,
                    ro_paths=[Path("/cache/npm/pi")], **kw)


def test_docker_run_line(tmp_path):
    rt = DockerRuntime("python:3.11-slim", tmp_path / "gw.sock", docker="/usr/bin/docker", cpus=2)
    cmd = rt.command(spec(tmp_path), name="polar-x")
    assert cmd[:6] == ["/usr/bin/docker", "run", "--rm", "--init", "--name", "polar-x"]
    assert cmd[cmd.index("--network") + 1] == "none"
    joined = " ".join(cmd)
    for part in (f"-v {tmp_path}/ws:/workspace", f"-v {tmp_path}/home:/home/agent", "-v /cache/npm/pi:/cache/npm/pi:ro",
                 f"-v {TUNNEL}:/run/polar/tunnel.py:ro", f"-v {tmp_path}/gw.sock:/run/polar/gateway.sock",
                 "--memory 2048m --memory-swap 2048m", "--cpus 2", "--ulimit cpu=600", "--ulimit nofile=1024", "-e A=1 -e B=2"):
        assert part in joined
    image_at = cmd.index("python:3.11-slim")
    assert cmd[image_at + 1:] == ["python3", "/run/polar/tunnel.py", "--listen", "127.0.0.1:8100", "--unix",
                                  "/run/polar/gateway.sock", "--", "agent", "--go"]
    host = rt.command(spec(tmp_path, network="host"))
    assert host[host.index("--network") + 1] == "host" and "tunnel.py" not in " ".join(host)


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
    rt = DockerRuntime("img", tmp_path / "gw.sock")
    s = spec(tmp_path)
    s.gateway_port = 80
    cmd = rt.command(s)
    assert cmd[cmd.index("--listen") + 1] == "127.0.0.1:10080" and rt.gateway_url(80) == "http://127.0.0.1:10080"
    assert rt.gateway_url(8100) == "http://127.0.0.1:8100"


async def test_absent_engines_fail_clearly(tmp_path):
    with pytest.raises(RuntimeUnavailable, match="docker CLI is not installed"):
        await DockerRuntime("img", tmp_path / "gw.sock", docker="/nonexistent/docker").run(spec(tmp_path))
    with pytest.raises(RuntimeUnavailable, match="apptainer: neither"):
        await ApptainerRuntime("img", tmp_path / "gw.sock", apptainer="/nonexistent/apptainer").run(spec(tmp_path))
    with pytest.raises(ValueError, match="needs an image"):
        make_runtime("docker")
    with pytest.raises(ValueError, match="unknown runtime 'k8s'"):
        make_runtime("k8s")
