"""The ``bwrap`` runtime: a bubblewrap sandbox that sees its workspace and a read-only system only.

Layout inside: ``/usr`` (and the /bin, /lib... links), a minimal ``/etc``, the npm CLIs and other
``ro_paths`` read-only at their host paths; ``/workspace`` and ``/home/agent`` writable (bound from the
session's directories); a private ``/tmp``, ``/proc`` and ``/dev``. All namespaces are unshared, the
program runs as uid 1000, and it dies with the node. Network: a fresh namespace with only loopback;
with ``network="gateway"`` the tunnel (tunnel.py) listens on the sandbox's 127.0.0.1 at the gateway's
port number and relays to the node's unix socket, which is the only thing bound in from outside.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .base import HostSandbox, ExecResult, ExecSpec, RuntimeUnavailable, prlimit_argv, run_process, sandbox_port

WORKSPACE = "/workspace"
HOME = "/home/agent"
SOCK_DIR = "/run/polar"
TUNNEL = Path(__file__).with_name("tunnel.py")
# /etc entries programs need to resolve names and users; the rest of /etc (shadow, ssh keys...) stays out.
ETC_ENTRIES = ("hosts", "nsswitch.conf", "resolv.conf", "localtime", "ssl", "ca-certificates", "alternatives",
               "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "mime.types", "gitconfig")
UID = 1000


def system_binds(root: Path = Path("/")) -> list[str]:
    """/usr read-only plus /bin, /lib, /lib64, /sbin as the host has them (symlinks into /usr on Debian)."""
    args = ["--ro-bind", str(root / "usr"), "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = root / name
        if p.is_symlink():
            args += ["--symlink", str(p.readlink()), f"/{name}"]
        elif p.is_dir():
            args += ["--ro-bind", str(p), f"/{name}"]
    for name in ETC_ENTRIES:
        if (root / "etc" / name).exists():
            args += ["--ro-bind", str(root / "etc" / name), f"/etc/{name}"]
    return args


class BwrapRuntime(HostSandbox):
    name = "bwrap"

    def __init__(self, sock_path: Path | None = None, *, bwrap: str | None = None, python: str | None = None):
        """``sock_path``: the node's unix socket that reaches the gateway (needed for network="gateway")."""
        self.bwrap = bwrap or shutil.which("bwrap") or ""
        self.sock_path = sock_path
        self.python = python or ("/usr/bin/python3" if Path("/usr/bin/python3").exists() else "python3")

    def workspace_view(self, spec_workspace: Path, mount: str = "") -> str:
        return mount or WORKSPACE

    def home_view(self, spec_home: Path) -> str:
        return HOME

    def gateway_url(self, gateway_port: int) -> str:
        return f"http://127.0.0.1:{sandbox_port(gateway_port)}"

    def command(self, spec: ExecSpec) -> list[str]:
        """prlimit + bwrap + (tunnel when the gateway is wanted) + argv."""
        ident = spec.home.parent / ".sandbox-etc"  # written by run(): passwd/group naming uid 1000
        args = [self.bwrap or "bwrap", "--die-with-parent", "--unshare-all", "--unshare-user", "--uid", str(UID), "--gid", str(UID),
                "--hostname", "polar-sandbox"]
        if spec.network == "host":
            args.append("--share-net")
        args += system_binds()
        args += ["--ro-bind", str(ident / "passwd"), "/etc/passwd", "--ro-bind", str(ident / "group"), "/etc/group"]
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        workdir = spec.mount or WORKSPACE
        args += ["--bind", str(spec.workspace), workdir, "--bind", str(spec.home), HOME]
        for seen_at, host in spec.mounts.items():
            args += ["--bind", str(host), seen_at]
        for p in spec.ro_paths:
            args += ["--ro-bind", str(p), str(p)]
        tunnel: list[str] = []
        if spec.network == "gateway":
            if self.sock_path is None or spec.gateway_port is None:
                raise RuntimeUnavailable("bwrap: network='gateway' needs the node's gateway socket and port")
            args += ["--ro-bind", str(TUNNEL), f"{SOCK_DIR}/tunnel.py", "--bind", str(self.sock_path), f"{SOCK_DIR}/gateway.sock"]
            tunnel = [self.python, "-I", f"{SOCK_DIR}/tunnel.py", "--listen", f"127.0.0.1:{sandbox_port(spec.gateway_port)}",
                      "--unix", f"{SOCK_DIR}/gateway.sock", "--"]
        args += ["--chdir", workdir, "--"]
        return [*prlimit_argv(spec.limits), *args, *tunnel, *spec.argv]

    async def run(self, spec: ExecSpec) -> ExecResult:
        """Run inside the sandbox; raises RuntimeUnavailable when bubblewrap is not installed."""
        if not self.bwrap:
            raise RuntimeUnavailable("bwrap: bubblewrap is not installed (Debian: apt-get install bubblewrap)")
        if spec.network == "gateway" and self.sock_path is not None and not self.sock_path.exists():
            raise RuntimeUnavailable(f"bwrap: the gateway socket {self.sock_path} is gone (was the node's directory removed?)")
        ident = spec.home.parent / ".sandbox-etc"
        ident.mkdir(parents=True, exist_ok=True)
        (ident / "passwd").write_text(f"root:x:0:0:root:/root:/bin/sh\nagent:x:{UID}:{UID}:agent:{HOME}:/bin/sh\n")
        (ident / "group").write_text(f"root:x:0:\nagent:x:{UID}:\n")
        return await run_process(self.command(spec), spec.env, spec.workspace, spec.limits.timeout_s, spec.log_path)
