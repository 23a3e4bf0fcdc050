"""Child processes of the demo: start with a log file, wait for health, stop them all on the way out."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessFailed(RuntimeError):
    """A child exited early or never became healthy; the message carries the tail of its log."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise ProcessFailed(f"{self.name} exited with code {self.proc.returncode}; last lines of {self.log}:\n{self.tail()}")


@dataclass
class Processes:
    """The demo's children. Each gets its own process group so stopping one never signals the others."""

    log_dir: Path
    env: dict[str, str]
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, *args: str) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "polarstream", *args], stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env={**os.environ, **self.env}, start_new_session=True,
            )
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def wait_http(self, child: Child, url: str, timeout: float = 120.0) -> None:
        """Wait until ``url`` answers 200, failing fast if the child dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            child.check_alive()
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise ProcessFailed(f"{child.name} did not answer {url} within {timeout:.0f}s; last lines of {child.log}:\n{child.tail()}")

    def check_all(self, finished_ok: frozenset[str] = frozenset()) -> None:
        """Raise if a child exited; those named in ``finished_ok`` may have exited with code 0."""
        for c in self.children:
            if c.name in finished_ok and c.proc.poll() == 0:
                continue
            c.check_alive()

    def stop_all(self, grace: float = 10.0) -> None:
        """SIGTERM every child's process group (last started first), then SIGKILL what is left."""
        for c in reversed(self.children):
            if c.proc.poll() is None:
                try:
                    os.killpg(c.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for c in self.children:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in self.children:
            try:
                os.killpg(c.proc.pid, signal.SIGKILL)  # also reaps grandchildren left in the group
            except ProcessLookupError:
                pass
            c.proc.wait()
