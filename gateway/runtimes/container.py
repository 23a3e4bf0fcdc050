"""``docker`` and ``apptainer`` runtimes for users' clusters.

Same contract as bwrap: the workspace at /workspace, a private HOME at /home/agent, no network but the
gateway (``--network none`` plus the unix-socket tunnel, so the image needs ``python3``), resource limits
from the spec. Neither engine exists on the machine this project is developed on, so the command lines
are built by pure functions and unit-tested; ``run`` only executes them.
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path

from .base import ExecResult, ExecSpec, RuntimeUnavailable, prlimit_argv, run_process, sandbox_port
from .bwrap import HOME, SOCK_DIR, TUNNEL, WORKSPACE


def _tunnel_argv(python: str, spec: ExecSpec) -> list[str]:
    if spec.network != "gateway":
        return []
    if spec.gateway_port is None:
        raise RuntimeUnavailable("network='gateway' needs the gateway port")
    return [python, f"{SOCK_DIR}/tunnel.py", "--listen", f"127.0.0.1:{sandbox_port(spec.gateway_port)}",
            "--unix", f"{SOCK_DIR}/gateway.sock", "--"]


class DockerRuntime:
    name = "docker"

    def __init__(self, image: str, sock_path: Path | None = None, *, docker: str | None = None, python: str = "python3",
                 cpus: float | None = None, pids_limit: int | None = 512, user: str | None = None):
        self.image, self.sock_path, self.python = image, sock_path, python
        self.docker = docker or shutil.which("docker") or ""
        self.cpus, self.pids_limit, self.user = cpus, pids_limit, user

    def workspace_view(self, spec_workspace: Path, mount: str = "") -> str:
        return mount or WORKSPACE

    def home_view(self, spec_home: Path) -> str:
        return HOME

    def gateway_url(self, gateway_port: int) -> str:
        return f"http://127.0.0.1:{sandbox_port(gateway_port)}"

    def command(self, spec: ExecSpec, name: str = "polar-run") -> list[str]:
        """``docker run`` for ``spec``; ``name`` lets a timeout remove the container."""
        lim = spec.limits
        workdir = spec.mount or WORKSPACE
        args = [self.docker or "docker", "run", "--rm", "--init", "--name", name, "-w", workdir,
                "--network", "host" if spec.network == "host" else "none",
                "-v", f"{spec.workspace}:{workdir}", "-v", f"{spec.home}:{HOME}"]
        args += [a for seen_at, host in spec.mounts.items() for a in ("-v", f"{host}:{seen_at}")]
        args += [a for p in spec.ro_paths for a in ("-v", f"{p}:{p}:ro")]
        if spec.network == "gateway":
            if self.sock_path is None:
                raise RuntimeUnavailable("docker: network='gateway' needs the node's gateway socket")
            args += ["-v", f"{TUNNEL}:{SOCK_DIR}/tunnel.py:ro", "-v", f"{self.sock_path}:{SOCK_DIR}/gateway.sock"]
        if lim.memory_mb:
            args += ["--memory", f"{lim.memory_mb}m", "--memory-swap", f"{lim.memory_mb}m"]
        if self.cpus:
            args += ["--cpus", str(self.cpus)]
        if self.pids_limit:
            args += ["--pids-limit", str(self.pids_limit)]
        if lim.cpu_s:
            args += ["--ulimit", f"cpu={lim.cpu_s}"]
        if lim.nofile:
            args += ["--ulimit", f"nofile={lim.nofile}"]
        if self.user:
            args += ["--user", self.user]
        for k, v in sorted(spec.env.items()):
            args += ["-e", f"{k}={v}"]
        return [*args, self.image, *_tunnel_argv(self.python, spec), *spec.argv]

    async def run(self, spec: ExecSpec) -> ExecResult:
        """Run the container; on timeout the container is removed, not just the client killed."""
        if not (self.docker and shutil.which(self.docker)):
            raise RuntimeUnavailable(f"docker: the docker CLI is not installed ({self.docker or 'not on PATH'})")
        name = f"polar-{uuid.uuid4().hex[:12]}"
        result = await run_process(self.command(spec, name), {"PATH": "/usr/local/bin:/usr/bin:/bin"}, spec.workspace,
                                   spec.limits.timeout_s, spec.log_path)
        if result.timed_out:
            proc = await asyncio.create_subprocess_exec(self.docker, "rm", "-f", name, stdout=asyncio.subprocess.DEVNULL,
                                                        stderr=asyncio.subprocess.DEVNULL)
            await proc.wait()
        return result


class ApptainerRuntime:
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
