"""The ``apptainer`` runtime for users' HPC clusters (podman and docker: podman.py).

Same contract as bwrap: the workspace at /workspace, a private HOME at /home/agent, no network but the
gateway (its own network namespace plus the unix-socket tunnel, so the image needs ``python3``), resource
limits from the spec. Apptainer is not installable on the machine this project is developed on, so the
command line is built by a pure function and unit-tested; ``run`` only executes it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .base import HostSandbox, ExecResult, ExecSpec, RuntimeUnavailable, prlimit_argv, run_process, sandbox_port
from .bwrap import HOME, SOCK_DIR, TUNNEL, WORKSPACE


def _tunnel_argv(python: str, spec: ExecSpec) -> list[str]:
    if spec.network != "gateway":
        return []
    if spec.gateway_port is None:
        raise RuntimeUnavailable("network='gateway' needs the gateway port")
    return [python, f"{SOCK_DIR}/tunnel.py", "--listen", f"127.0.0.1:{sandbox_port(spec.gateway_port)}",
            "--unix", f"{SOCK_DIR}/gateway.sock", "--"]


class ApptainerRuntime(HostSandbox):
    name = "apptainer"

    def __init__(self, image: str, sock_path: Path | None = None, *, apptainer: str | None = None, python: str = "python3"):
        self.image, self.sock_path, self.python = image, sock_path, python
        self.apptainer = apptainer or shutil.which("apptainer") or shutil.which("singularity") or ""

    def workspace_view(self, spec_workspace: Path, mount: str = "") -> str:
        return mount or WORKSPACE

    def home_view(self, spec_home: Path) -> str:
        return HOME

    def gateway_url(self, gateway_port: int) -> str:
        return f"http://127.0.0.1:{sandbox_port(gateway_port)}"

    def command(self, spec: ExecSpec) -> list[str]:
        """``apptainer exec`` (rootless): contained, clean env, own network namespace unless network=host."""
        workdir = spec.mount or WORKSPACE
        binds = [f"{spec.workspace}:{workdir}", f"{spec.home}:{HOME}", *(f"{p}:{p}:ro" for p in spec.ro_paths),
                 *(f"{host}:{seen_at}" for seen_at, host in spec.mounts.items())]
        if spec.network == "gateway":
            if self.sock_path is None:
                raise RuntimeUnavailable("apptainer: network='gateway' needs the node's gateway socket")
            binds += [f"{TUNNEL}:{SOCK_DIR}/tunnel.py:ro", f"{self.sock_path}:{SOCK_DIR}/gateway.sock"]
        args = [self.apptainer or "apptainer", "exec", "--containall", "--cleanenv", "--no-home", "--pwd", workdir,
                "--bind", ",".join(binds)]
        if spec.network != "host":
            args += ["--net", "--network", "none"]
        for k, v in sorted(spec.env.items()):
            args += ["--env", f"{k}={v}"]
        # apptainer has no portable memory flag without cgroup delegation; prlimit's limits are inherited.
        return [*prlimit_argv(spec.limits), *args, self.image, *_tunnel_argv(self.python, spec), *spec.argv]

    async def run(self, spec: ExecSpec) -> ExecResult:
        """Run the container; RuntimeUnavailable when apptainer/singularity is not installed."""
        if not (self.apptainer and shutil.which(self.apptainer)):
            raise RuntimeUnavailable("apptainer: neither apptainer nor singularity is installed")
        return await run_process(self.command(spec), {"PATH": "/usr/local/bin:/usr/bin:/bin"}, spec.workspace,
                                 spec.limits.timeout_s, spec.log_path)
