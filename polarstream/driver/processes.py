"""The driver's child processes: start with a log file, wait for health, stop them all on the way out.

A run that names a registry file records each child's pid, command and port there. The children run in
sessions of their own, so a driver that is killed (SIGKILL, OOM) leaves them running; the same command
started again adopts every one that still runs its recorded command, instead of starting a second
trainer beside the first, and starts the others afresh.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from infra.process import free_port, pid_alive, stop_group


# A command's first word when it is not ``program``'s arguments: the trainer's several processes (components.torchrun)
TORCHRUN = "torchrun"


class ProcessFailed(RuntimeError):
    """A child exited early or never became healthy; the message carries the tail of its log."""


class Stopped(KeyboardInterrupt):
    """SIGTERM, taken as Ctrl-C is: the ``finally`` that stops the children runs. The children run in
    sessions of their own, so nothing else reaches them, and a deployment (or a shell script, whose
    background jobs ignore SIGINT) stops a run with SIGTERM."""

    exit_code = 128 + signal.SIGTERM


def stop_on_sigterm() -> None:
    """From now on SIGTERM raises Stopped in the main thread, once (a second one during the cleanup is
    ignored, so it cannot cut the cleanup short)."""

    def stop(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Stopped

    signal.signal(signal.SIGTERM, stop)


class Adopted:
    """A component an earlier driver started and left running: watched by its pid (not our child, so its
    exit code is unknown: -1 once it is gone)."""

    def __init__(self, pid: int, args: list[str] | tuple[str, ...]):
        self.pid, self.returncode, self.marker = pid, None, _marker(args)

    def poll(self) -> int | None:
        if self.returncode is None and not pid_alive(self.pid, self.marker):
            self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.1)
        return self.returncode


def _marker(args: list[str] | tuple[str, ...]) -> str:
    """What a child's command line holds for ``args``, whole arguments only (its NUL-separated form); torchrun
    runs as ``python -m torch.distributed.run``, so its own name is not on it."""
    if args[:1] in ([TORCHRUN], (TORCHRUN,)):
        args = args[1:]
    return "\0" + "\0".join(args) + "\0"


def children_of(pid: int) -> list[int]:
    """The children of ``pid``: torchrun starts each rank in a session of its own, which signalling torchrun's
    process group does not reach."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return kids


@dataclass
class Child:
    name: str
    proc: subprocess.Popen | Adopted
    log: Path
    args: tuple[str, ...] = ()
    restarts: int = 0

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
    """The run's children. Each gets its own process group so stopping one never signals the others."""

    log_dir: Path
    env: dict[str, str]
    children: list[Child] = field(default_factory=list)
    registry: Path | None = None  # where pids, commands and ports are kept for a restarted driver
    program: tuple[str, ...] = (sys.executable, "-m", "polarstream")  # what every child runs, with its args

    def __post_init__(self) -> None:
        self._recorded: dict = {"ports": {}, "children": {}}
        if self.registry is not None and self.registry.exists():
            self._recorded = json.loads(self.registry.read_text())

    def port(self, name: str) -> int:
        """A free port for ``name``, or the one recorded for it (where an adopted child still listens)."""
        ports = self._recorded["ports"]
        if name not in ports:
            ports[name] = free_port()
            self._save()
        return ports[name]

    def _save(self) -> None:
        if self.registry is not None:
            # merged: what an earlier driver recorded stays until this one starts (or adopts) that component
            self._recorded["children"].update({c.name: {"pid": c.proc.pid, "args": list(c.args)} for c in self.children})
            self.registry.write_text(json.dumps(self._recorded, indent=1) + "\n")

    def command(self, args: tuple[str, ...]) -> list[str]:
        """``program ARGS``, or torchrun's command (components.torchrun) with this Python (the venv's torch)."""
        if args[:1] == (TORCHRUN,):
            return [sys.executable, "-m", "torch.distributed.run", *args[1:]]
        return [*self.program, *args]

    def _spawn(self, name: str, args: tuple[str, ...], log: Path) -> subprocess.Popen:
        with open(log, "ab") as out:
            return subprocess.Popen(
                self.command(args), stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env={**os.environ, **self.env}, start_new_session=True,
            )

    def start(self, name: str, *args: str) -> Child:
        """Start ``polarstream ARGS`` as ``name``, or adopt the running one an earlier driver left."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        was = self._recorded["children"].get(name)
        running = bool(was) and pid_alive(was["pid"], _marker(was["args"]))
        if running and was["args"] == list(args):
            proc: subprocess.Popen | Adopted = Adopted(was["pid"], args)
        else:
            if running:  # the earlier driver's, with another command: it would hold the port this one needs
                stop_group(Adopted(was["pid"], was["args"]))
            proc = self._spawn(name, args, log)
        child = Child(name, proc, log, args)
        self.children.append(child)
        self._save()
        return child

    @property
    def adopted(self) -> list[str]:
        return [c.name for c in self.children if isinstance(c.proc, Adopted)]

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

    def check_all(self, finished_ok: frozenset[str] = frozenset(), restart: frozenset[str] = frozenset(),
                  max_restarts: int = 3) -> list[str]:
        """Raise if a child exited; those named in ``finished_ok`` may have exited with code 0 (an adopted
        one with any: its code is unknown), and those in ``restart`` that died are started again with
        the same command, at most ``max_restarts`` times each. Returns the names restarted now."""
        restarted = []
        for c in self.children:
            code = c.proc.poll()
            if code is None or (c.name in finished_ok and (code == 0 or isinstance(c.proc, Adopted))):
                continue
            if c.name in restart and c.restarts < max_restarts:
                c.proc, c.restarts = self._spawn(c.name, c.args, c.log), c.restarts + 1
                restarted.append(c.name)
                self._save()
                continue
            c.check_alive()
        return restarted

    def stop_all(self, grace: float = 10.0) -> None:
        """SIGTERM every child's process group (last started first), then SIGKILL what is left (torchrun's
        ranks too: torchrun stops them on SIGTERM, but a rank it had no time to stop would outlive it)."""
        ranks = {c.name: children_of(c.proc.pid) for c in self.children if c.args[:1] == (TORCHRUN,)}
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
            for pid in (c.proc.pid, *ranks.get(c.name, ())):
                try:
                    os.killpg(pid, signal.SIGKILL)  # also reaps grandchildren left in the group
                except ProcessLookupError:
                    pass
            c.proc.wait()
        if self.registry is not None:
            self.registry.unlink(missing_ok=True)  # nothing left to adopt
