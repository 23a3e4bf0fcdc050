"""The bwrap sandbox: workspace only, read-only system, no network but the gateway, limits enforced."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest

from gateway.runtimes import BwrapRuntime, ExecSpec, Limits, SubprocessRuntime
from gateway.runtimes.tunnel import serve_unix_to_tcp


def _bwrap_works() -> str:
    if not shutil.which("bwrap"):
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    p = subprocess.run(["bwrap", "--unshare-all", "--unshare-user", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
                        "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "/bin/true"], capture_output=True, text=True)
    return "" if p.returncode == 0 else f"bwrap cannot create namespaces here: {p.stderr.strip()}"


_WHY = _bwrap_works()
needs_bwrap = pytest.mark.skipif(bool(_WHY), reason=_WHY)


async def _http_server(body: bytes):
    async def handle(reader, writer):
        await reader.read(1000)
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _dirs(tmp_path: Path) -> tuple[Path, Path]:
    ws, home = tmp_path / "s" / "workspace", tmp_path / "s" / "home"
    ws.mkdir(parents=True)
    home.mkdir()
    return ws, home


PROBE = """
import os, socket, sys, urllib.request
def connect(host, port):
    s = socket.socket(); s.settimeout(2)
    try:
        return s.connect_ex((host, port))
    finally:
        s.close()
print("gateway", urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/", timeout=5).read().decode())
print("other_local_port", connect("127.0.0.1", int(sys.argv[2])))
print("outside_address", connect("10.255.255.1", 80))
for path in sys.argv[3:]:
    try:
        open(path).read(); print("read", path, "OK")
    except OSError as e:
        print("read", path, type(e).__name__)
try:
    open("/usr/polar-probe", "w"); print("write_usr OK")
except OSError as e:
    print("write_usr", type(e).__name__)
open("made-inside.txt", "w").write("x")
print("cwd", os.getcwd(), "uid", os.getuid(), "home", os.environ["HOME"])
"""


@needs_bwrap
async def test_sandbox_sees_only_workspace_and_reaches_only_the_gateway(tmp_path):
    ws, home = _dirs(tmp_path)
    secret = tmp_path / "other-session" / "secret.txt"  # e.g. a neighbour's workspace
    secret.parent.mkdir()
    secret.write_text("do not read")
    gateway, gw_port = await _http_server(b"hello-from-gateway")
    other, other_port = await _http_server(b"should-not-see")  # another service on the host's loopback
    sock = tmp_path / "gateway.sock"
    relay = await serve_unix_to_tcp(str(sock), "127.0.0.1", gw_port)
    rt = BwrapRuntime(sock)
    spec = ExecSpec(argv=[rt.python, "-c", PROBE, str(gw_port), str(other_port), str(secret), str(Path.home() / ".bashrc"), "/etc/shadow"],
                    env={"PATH": "/usr/bin:/bin", "HOME": rt.home_view(home)}, workspace=ws, home=home,
                    limits=Limits(timeout_s=30), gateway_port=gw_port, log_path=tmp_path / "log")
    try:
        res = await rt.run(spec)
    finally:
        for s in (relay, gateway, other):
            s.close()
    out = dict(line.rsplit(" ", 1) if line.startswith("read") else line.split(" ", 1) for line in res.output_tail.strip().splitlines())
    assert res.returncode == 0, res.output_tail
    assert out["gateway"] == "hello-from-gateway"
    assert out["other_local_port"] == "111"  # ECONNREFUSED: the sandbox's loopback is its own
    assert out["outside_address"] == "101"  # ENETUNREACH: no route anywhere
    assert out[f"read {secret}"] == "FileNotFoundError" and out["read /etc/shadow"] == "FileNotFoundError"
    assert out[f"read {Path.home() / '.bashrc'}"] == "FileNotFoundError"
    assert out["write_usr"] in ("OSError", "PermissionError")
    assert out["cwd"] == "/workspace uid 1000 home /home/agent"
    assert (ws / "made-inside.txt").read_text() == "x"  # the workspace itself is writable


@needs_bwrap
async def test_sandbox_without_gateway_has_no_network(tmp_path):
    ws, home = _dirs(tmp_path)
    rt = BwrapRuntime(None)
    code = "import socket; s = socket.socket(); s.settimeout(2); print(s.connect_ex(('1.1.1.1', 443)))"
    res = await rt.run(ExecSpec(argv=[rt.python, "-c", code], env={"PATH": "/usr/bin"}, workspace=ws, home=home, network="none",
                                log_path=tmp_path / "log"))
    assert res.returncode == 0 and res.output_tail.strip() == "101"


@needs_bwrap
async def test_limits_memory_and_wall_clock(tmp_path):
    ws, home = _dirs(tmp_path)
    rt = BwrapRuntime(None)
    hog = "b = bytearray(600 * 2**20); print('allocated')"
    res = await rt.run(ExecSpec(argv=[rt.python, "-c", hog], env={}, workspace=ws, home=home, network="none",
                                limits=Limits(memory_mb=300, timeout_s=30), log_path=tmp_path / "mem.log"))
    assert res.returncode != 0 and "MemoryError" in res.output_tail
    # a sandboxed child that ignores SIGTERM and forks still dies at the wall-clock limit
    sleeper = "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); os.fork(); time.sleep(60)"
    res = await rt.run(ExecSpec(argv=[rt.python, "-c", sleeper], env={}, workspace=ws, home=home, network="none",
                                limits=Limits(timeout_s=1.5), log_path=tmp_path / "t.log"))
    assert res.timed_out and res.returncode is None and res.duration_s < 10


async def test_subprocess_runtime_cpu_limit_and_env_isolation(tmp_path, monkeypatch):
    ws, home = _dirs(tmp_path)
    monkeypatch.setenv("POLAR_LEAK_CHECK", "leaked")
    rt = SubprocessRuntime()
    code = "import os; print(os.environ.get('POLAR_LEAK_CHECK', 'clean'), os.getcwd(), flush=True)\nwhile True: pass"
    res = await rt.run(ExecSpec(argv=[rt.python, "-c", code], env={"HOME": str(home)}, workspace=ws, home=home,
                                limits=Limits(cpu_s=1, timeout_s=20), log_path=tmp_path / "log"))
    assert res.returncode != 0 and not res.timed_out  # SIGXCPU/SIGKILL from RLIMIT_CPU, well before the wall clock
    assert res.output_tail.split() == ["clean", str(ws)]
