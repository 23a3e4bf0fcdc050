"""What a runtime is: something that runs one argv in a workspace under limits, and how it is run.

A runtime maps the host's workspace and private HOME to the paths the program sees, decides which
network the program gets (only the gateway, none, or the host's), applies CPU/memory/time limits and
returns the exit status. Runtimes build their command line in a pure ``command(spec)`` method (unit
tested even where the engine, e.g. Docker, is absent) and share one process runner.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

Network = Literal["gateway", "none", "host"]
PRLIMIT = shutil.which("prlimit") or "/usr/bin/prlimit"


@dataclass(frozen=True)
class Limits:
    """Resource limits of one run; None means unlimited."""

    timeout_s: float | None = None  # wall clock, enforced by killing the whole run
    cpu_s: int | None = None  # RLIMIT_CPU: CPU seconds per process
    memory_mb: int | None = None  # RLIMIT_AS: address space per process (Node/V8 needs a few GB)
    nofile: int | None = 4096  # open files per process
    fsize_mb: int | None = None  # largest file a process may write


@dataclass
class ExecSpec:
    """One program run: what, where, with which environment, network and limits."""

    argv: list[str]
    env: dict[str, str]
    workspace: Path  # host directory, writable; the program's cwd
    home: Path  # host directory, writable; the program's HOME
    limits: Limits = field(default_factory=Limits)
    network: Network = "gateway"
    gateway_port: int | None = None  # TCP port of the gateway on the host's 127.0.0.1
    ro_paths: list[Path] = field(default_factory=list)  # extra host paths visible read-only (npm CLIs)
    log_path: Path | None = None  # stdout+stderr go here (and are tailed into the result)
    # Where the program sees ``workspace`` ("" = the runtime's own place) and further writable host
    # directories by the path it sees them at (a Harbor verifier's /tests and /logs/verifier). Only the
    # sandboxing runtimes can place them; the subprocess runtime refuses a spec that asks.
    mount: str = ""
    mounts: dict[str, Path] = field(default_factory=dict)


@dataclass
class ExecResult:
    returncode: int | None  # None when killed by the wall-clock limit
    timed_out: bool
    duration_s: float
    output_tail: str = ""


class RuntimeUnavailable(RuntimeError):
    """The runtime's engine (bwrap, docker, apptainer) is missing or cannot start here."""


class Runtime(Protocol):
    """A way to run programs. Implementations: subprocess, bwrap, apptainer (each its own sandbox) and
    podman/docker, whose ``open`` gives each session a container of its own (podman.py)."""

    name: str
    python: str  # a python interpreter path valid inside the runtime
    persistent: bool  # True: runs share one container's state (a session's), not a host directory

    async def open(self, task, root: Path, ro_paths: list[Path] = (), node_binary: bool = False,
                   log_path: Path | None = None) -> "Runtime":
        """The sandbox one session runs in (a container for an image task; the runtime itself for the
        others). RuntimeUnavailable or images.ImageBuildError when it cannot be made."""

    async def close(self) -> None:
        """Remove what ``open`` made (nothing for a runtime that is its own sandbox)."""

    def workspace_view(self, spec_workspace: Path, mount: str = "") -> str:
        """The workspace path as the program sees it (``mount``: where the task wants it)."""

    def home_view(self, spec_home: Path) -> str:
        """HOME as the program sees it."""

    def gateway_url(self, gateway_port: int) -> str:
        """Base URL of the gateway as the program reaches it."""

    def command(self, spec: ExecSpec) -> list[str]:
        """The full host command line for ``spec`` (pure; no I/O)."""

    async def run(self, spec: ExecSpec) -> ExecResult:
        """Run ``spec`` to completion or until its wall-clock limit."""


class HostSandbox:
    """Mixin of the runtimes whose runs are independent programs over a host workspace directory: a
    session's sandbox is the runtime itself."""

    persistent = False

    async def open(self, task, root: Path, ro_paths: list[Path] = (), node_binary: bool = False,
                   log_path: Path | None = None) -> "HostSandbox":
        if getattr(task, "environment", None) is not None:  # its workspace is in an image we cannot run
            raise RuntimeUnavailable(f"task {task.task_id} brings an image; runtime {self.name} runs none (use auto or podman)")
        return self

    async def close(self) -> None:
        return None


def sandbox_port(gateway_port: int) -> int:
    """Port the tunnel listens on inside a sandbox: the gateway's own, unless that is privileged.

    The sandboxed user (uid 1000) may not bind ports below 1024, so a gateway on port 80 is reached at
    10080 inside; the harness only ever sees the inside URL.
    """
    return gateway_port if gateway_port >= 1024 else 10000 + gateway_port


def command_env(runtime: "Runtime", home: Path) -> dict[str, str]:
    """The environment of a node's own commands in a runtime (prepare, verifiers, a task's solution):
    system PATH, the private HOME as the program sees it, a UTF-8 locale, nothing of the node's."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": runtime.home_view(home), "LANG": "C.UTF-8"}


def prlimit_argv(limits: Limits) -> list[str]:
    """``prlimit --cpu=.. --as=.. --`` prefix for ``limits`` ([] when none is set).

    util-linux prlimit sets the limits on itself and then execs the program, so every child inherits
    them; unlike a preexec_fn it is safe in our threaded node and visible in the command line.
    """
    flags = []
    if limits.cpu_s is not None:
        flags.append(f"--cpu={int(limits.cpu_s)}")
    if limits.memory_mb is not None:
        flags.append(f"--as={int(limits.memory_mb) * 2**20}")
    if limits.nofile is not None:
        flags.append(f"--nofile={int(limits.nofile)}")
    if limits.fsize_mb is not None:
        flags.append(f"--fsize={int(limits.fsize_mb) * 2**20}")
    return [PRLIMIT, *flags, "--"] if flags else []


def _tail(path: Path | None, n: int = 4000) -> str:
    if path is None or not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - n))
        return f.read().decode(errors="replace")


async def run_process(argv: list[str], env: dict[str, str], cwd: Path, timeout_s: float | None, log_path: Path | None) -> ExecResult:
    """Start ``argv`` in its own process group and wait, killing the whole group on timeout.

    The group kill matters: harnesses spawn shells and language servers, and a timeout that killed only
    the top process would leave them running with the workspace open. Output goes to ``log_path`` (a
    file, never a pipe, so a chatty program can't block on a full pipe buffer).
    """
    log = open(log_path, "ab") if log_path else open(os.devnull, "wb")
    t0 = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=str(cwd), env=env, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as e:
        log.close()
        raise RuntimeUnavailable(f"cannot start {argv[0]}: {e}") from e
    timed_out = False
    try:
        await asyncio.wait_for(proc.wait(), timeout=timeout_s)
    except asyncio.TimeoutError:
        timed_out = True
    except asyncio.CancelledError:
        _kill_group(proc.pid)
        await proc.wait()
        raise
    finally:
        if timed_out:
            _kill_group(proc.pid)
            await proc.wait()
        log.close()
    return ExecResult(None if timed_out else proc.returncode, timed_out, time.monotonic() - t0, _tail(log_path))


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
