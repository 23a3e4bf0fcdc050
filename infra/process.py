"""Run a Java server as a detached process that a later, separate process can find and stop.

``Service`` is the process handle (pid file, log, marker); ``JavaServer`` is the lifecycle every Java
server of ours shares (launch from Maven jars, wait until it answers, stop, status), so a server is a
small subclass that writes its config files and says how to tell it is ready.

Each service keeps a pid file (JSON) in its data directory. A pid alone is not proof: the OS reuses
pids, so a service only counts as ours while ``/proc/<pid>/cmdline`` still contains its marker (the
path of its own config file). That is what lets ``polarstream infra down`` in one shell stop exactly
what ``up`` started in another, and never anything else.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from .errors import InfraError
from .maven import classpath, jar_dir
from .settings import Settings

MIN_JAVA = 17


# --------------------------------------------------------------------------------------- checks


def java_version(java: str = "java") -> int:
    """Major version of the ``java`` on PATH; InfraError when it is missing."""
    exe = shutil.which(java)
    if exe is None:
        raise InfraError(f"java not found on PATH: install Java {MIN_JAVA}+ (e.g. apt-get install openjdk-17-jre-headless)")
    out = subprocess.run([exe, "-version"], capture_output=True, text=True, timeout=30)
    return parse_java_version(out.stderr + out.stdout)


def parse_java_version(text: str) -> int:
    """Major version from ``java -version`` output ('1.8.0_402' -> 8, '17.0.15' -> 17)."""
    m = re.search(r'version "(\d+)(?:\.(\d+))?', text)
    if not m:
        raise InfraError(f"could not read the Java version from: {text.strip()[:200]!r}")
    major = int(m.group(1))
    return int(m.group(2) or 0) if major == 1 else major


def require_java() -> str:
    """Path of a java executable at least MIN_JAVA, or a one-line InfraError."""
    version = java_version()
    if version < MIN_JAVA:
        raise InfraError(f"java {version} is too old: Kafka 4 and s3proxy need Java {MIN_JAVA}+")
    return shutil.which("java")  # type: ignore[return-value]


def cds_archive(jar_dir: Path) -> Path:
    """Where the class-data archive for these jars and this JVM lives (one per java installation)."""
    java = os.path.realpath(shutil.which("java") or "java")
    return jar_dir / f"cds-{hashlib.sha256(java.encode()).hexdigest()[:8]}.jsa"


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing could listen on host:port now.

    SO_REUSEADDR mirrors what the JVM servers set, so a port whose last connections sit in TIME_WAIT
    (right after a restart) is not mistaken for a busy one.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def require_free_ports(what: str, ports: dict[str, int]) -> None:
    """InfraError naming the first of ``ports`` (name -> port) that is taken."""
    for name, port in ports.items():
        if port_in_use(port):
            raise InfraError(f"{what}: port {port} ({name}) is already in use; stop what holds it or choose another port")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux; the IANA range elsewhere)."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 49152, 65535


def stop_group(proc, steps=((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0))) -> None:
    """Signal the process group of ``proc`` (anything with ``pid`` and ``wait(timeout)``, the leader of its
    own session) step by step, waiting each step's grace for it to exit; gone already is fine."""
    for sig, grace in steps:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def free_port() -> int:
    """A port that is free now, chosen outside the kernel's ephemeral range.

    A port from ``bind(0)`` is an ephemeral one: in the seconds before a broker's JVM binds it, any
    outgoing connection on the machine may be given the same port as its local end, and the broker then
    dies with "Address already in use" (seen in CI). Ports below the ephemeral range are only ever taken
    by an explicit bind, so a random free one there stays free.
    """
    lo, hi = ephemeral_range()
    span = (10_000, lo - 1) if lo > 12_000 else (hi + 1, 65_535) if hi < 63_000 else None
    pick = random.SystemRandom()  # not the seeded global generator: parallel processes must not agree
    for _ in range(100 if span else 0):
        port = pick.randint(*span)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect_error(host: str, port: int, timeout: float) -> str | None:
    """None when host:port accepts a TCP connection, else why not (e.g. 'connection refused')."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except socket.gaierror:
        return f"unknown host {host!r}"
    except TimeoutError:
        return f"no answer within {timeout:g}s"
    except OSError as e:
        return (e.strerror or str(e)).lower()


def machine_cpu() -> tuple[float, float, int] | None:
    """(busy, total, cores): CPU time of the whole machine so far, summed over its cores, from /proc/stat
    (None elsewhere). Over an interval, Δbusy / Δtotal * cores is how many cores everything kept busy."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
        user, nice, system, idle, iowait, irq, softirq, steal = (float(x) for x in lines[0].split()[1:9])
    except (OSError, ValueError, IndexError):
        return None
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait, sum(line[:3] == "cpu" and line[3:4].isdigit() for line in lines)


def tcp_open(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    """True when something accepts TCP connections on host:port."""
    return connect_error(host, port, timeout) is None


def tail(path: Path, lines: int = 15) -> str:
    """Last lines of a log file, for error messages ('' when there is none)."""
    try:
        data = path.read_bytes()[-16384:]
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


# --------------------------------------------------------------------------------------- processes


def _pdeathsig() -> None:  # pragma: no cover - runs in the child between fork and exec
    # PR_SET_PDEATHSIG: the kernel sends SIGTERM when the starting thread dies, so a test session
    # killed with SIGKILL cannot leave brokers behind.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def pid_alive(pid: int, marker: str) -> bool:
    """True while ``pid`` runs and its command line contains ``marker`` (so a reused pid is not ours)."""
    try:  # an exited child of ours lingers as a zombie until reaped
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    for _ in range(50):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        if cmdline or state == "Z":
            return marker.encode() in cmdline
        # Empty but running: a child caught mid-exec (the kernel sets the new argv a moment after the
        # parent's Popen returns). Look again shortly rather than call it dead.
        time.sleep(0.01)
    return False


@dataclass
class Service:
    """A detached server process described by its pid file, log file and identifying marker."""

    name: str
    pid_file: Path
    log_file: Path
    marker: str  # a string unique to this instance's command line (its config file path)
    archive: Path | None = None  # AppCDS class-data archive shared by every run of the same jars
    _scratch: Path | None = None

    def cds_flags(self, record: bool = True) -> list[str]:
        """JVM flags that load the class-data archive, or (``record``) write one when this JVM exits.

        Loading ~6k classes dominates a broker's startup on a busy 2-core machine; a dynamic AppCDS
        archive halves the CPU it takes. The first run to stop cleanly leaves the archive behind for
        every later one. A stale or foreign archive is ignored by the JVM (-Xshare:auto), never fatal.
        """
        if self.archive is None:
            return []
        if self.archive.exists():
            return [f"-XX:SharedArchiveFile={self.archive}", "-Xshare:auto"]
        if not record:
            return []
        # Same directory as the archive so adopting it is an atomic rename.
        self._scratch = self.archive.with_name(f".{self.archive.name}.{os.getpid()}-{time.time_ns()}.tmp")
        return [f"-XX:ArchiveClassesAtExit={self._scratch}"]

    def _adopt_archive(self, info: dict | None) -> None:
        scratch = Path(info["cds_scratch"]) if info and info.get("cds_scratch") else None
        if scratch is None or self.archive is None:
            return
        if scratch.exists() and scratch.stat().st_size > 0 and not self.archive.exists():
            os.replace(scratch, self.archive)
        scratch.unlink(missing_ok=True)

    def info(self) -> dict | None:
        """The pid file's content, or None when there is none."""
        try:
            return json.loads(self.pid_file.read_text())
        except (OSError, ValueError):
            return None

    def pid(self) -> int | None:
        """Pid of the running instance, or None (a stale pid file is removed)."""
        info = self.info()
        if info is None:
            return None
        if pid_alive(int(info["pid"]), self.marker):
            return int(info["pid"])
        self.pid_file.unlink(missing_ok=True)
        return None

    def spawn(self, cmd: list[str], extra: dict, die_with_parent: bool = False) -> int:
        """Start ``cmd`` in its own session with output appended to the log file; write the pid file."""
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        # pdeathsig follows the thread that forks; from a worker thread it would fire when that thread
        # ends, so only the main thread asks for it.
        use_sig = die_with_parent and threading.current_thread() is threading.main_thread()
        with open(self.log_file, "ab") as log:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_pdeathsig if use_sig else None,
            )
        scratch, self._scratch = self._scratch, None
        self.pid_file.write_text(json.dumps({"pid": proc.pid, "started_at": time.time(),
                                             "cds_scratch": str(scratch) if scratch else None, **extra}))
        return proc.pid

    def wait_ready(self, ready: Callable[[], bool], timeout: float) -> None:
        """Poll ``ready`` until true; InfraError with the log's tail when the process dies or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pid() is None:
                raise InfraError(f"{self.name} exited during startup; log {self.log_file}:\n{tail(self.log_file)}")
            if ready():
                return
            time.sleep(0.1)
        raise InfraError(f"{self.name} did not become ready in {timeout:.0f}s; log {self.log_file}:\n{tail(self.log_file)}")

    def stop(self, timeout: float = 20.0, force: bool = False) -> bool:
        """SIGTERM, then SIGKILL after ``timeout`` (at once with ``force``); True when something was stopped."""
        pid, info = self.pid(), self.info()
        if pid is None:
            return False
        _signal(pid, signal.SIGKILL if force else signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and pid_alive(pid, self.marker):
            time.sleep(0.05)
        if pid_alive(pid, self.marker):
            _signal(pid, signal.SIGKILL)
            while pid_alive(pid, self.marker):
                time.sleep(0.05)
        self.pid_file.unlink(missing_ok=True)
        self._adopt_archive(info)
        return True


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


@dataclass
class JavaServer:
    """Base of the Java servers we run (Kafka, s3proxy, MirrorMaker 2): one instance per ``Settings``.

    A subclass sets ``kind`` (label and sub-directory of data_dir), ``profile`` (the Maven profile of
    its jars), the three file names, and implements ``prepare`` (write config, return main class and
    args) and ``answers`` (is it serving yet). Everything about processes lives here.
    """

    settings: Settings
    heap_mb: int = 256
    die_with_parent: bool = False  # tests set it so a killed test session leaves no server behind
    quick_jit: bool = False  # C1 only: starts with half the CPU; fine for short-lived test servers
    root: Path = field(init=False)

    kind: ClassVar[str] = ""
    profile: ClassVar[str] = ""
    config_name: ClassVar[str] = ""
    log_name: ClassVar[str] = ""
    pid_name: ClassVar[str] = ""
    xms_mb: ClassVar[int | None] = None

    def __post_init__(self) -> None:
        self.root = self.root_dir()
        self.service = Service(
            name=self.label(), pid_file=self.root / self.pid_name, log_file=self.root / self.log_name,
            marker=str(self.config_file), archive=cds_archive(jar_dir(self.profile, self.settings)),
        )

    # -- what a subclass describes --
    def root_dir(self) -> Path:
        """Directory holding config, log, pid file and data (``<data_dir>/<kind>`` by default)."""
        return self.settings.data_dir / self.kind

    def label(self) -> str:
        """Human name for errors ('kafka broker on 127.0.0.1:9092')."""
        return self.kind

    def ports(self) -> dict[str, int]:
        """Ports (name -> number) that must be free before a start."""
        return {}

    def identity(self) -> dict:
        """What a running instance must match (saved in its pid file), e.g. its port."""
        return {}

    def prepare(self) -> list[str]:
        """Write the config files under ``root``; return the main class and its arguments."""
        raise NotImplementedError

    def jvm_properties(self) -> list[str]:
        """Extra ``-D`` flags (logging config)."""
        return []

    def before_spawn(self, jvm: list[str]) -> None:
        """Hook run with the JVM command prefix (no main class) right before the spawn."""

    def run_info(self) -> dict:
        """Extra facts about this run for its pid file (read back by ``answers`` in any process)."""
        return {}

    def answers(self) -> bool:
        """True once the server serves requests."""
        raise NotImplementedError

    # -- the shared lifecycle --
    @property
    def config_file(self) -> Path:
        """The server's config file (also the marker that identifies its process)."""
        return self.root / self.config_name

    @property
    def log_file(self) -> Path:
        """Where the server logs."""
        return self.service.log_file

    def pid(self) -> int | None:
        """Pid of the running server, or None."""
        return self.service.pid()

    def start(self, timeout: float = 90.0) -> bool:
        """Start unless it runs already and wait until it answers; True when it started one."""
        started = self.launch()
        self.wait_ready(timeout)
        return started

    def launch(self) -> bool:
        """Spawn the server without waiting; False when it already runs (with the same identity)."""
        if self.pid() is not None:
            running = self.service.info() or {}
            for key, want in self.identity().items():
                if running.get(key) != want:
                    raise InfraError(f"{self.kind} from {self.root} already runs with {key} {running.get(key)}, not {want}: "
                                     "run `polarstream infra down` first or use another data_dir")
            return False
        java = require_java()
        require_free_ports(self.kind, self.ports())
        cp = classpath(self.profile, self.settings)
        self.root.mkdir(parents=True, exist_ok=True)
        main = self.prepare()
        jvm = [java, *([f"-Xms{self.xms_mb}m"] if self.xms_mb else []), f"-Xmx{self.heap_mb}m", "-XX:+UseSerialGC",
               "-Djava.awt.headless=true", *(["-XX:TieredStopAtLevel=1"] if self.quick_jit else []),
               *self.jvm_properties(), "-cp", cp]
        self.before_spawn(jvm)
        self.service.spawn([java, *self.service.cds_flags(), *jvm[1:], *main], extra={**self.run_info(), **self.identity()},
                           die_with_parent=self.die_with_parent)
        return True

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Block until it answers; InfraError with its log's tail if it dies or times out."""
        self.service.wait_ready(self.answers, timeout)

    def stop(self, timeout: float = 30.0, force: bool = False) -> bool:
        """SIGTERM (SIGKILL with ``force``, as a crash would); True when one was running."""
        return self.service.stop(timeout, force=force)

    def restart(self, timeout: float = 90.0, force: bool = False) -> None:
        """Stop (gracefully, or as a crash with ``force``) and start again on the same data."""
        self.stop(force=force)
        # A killed process stops looking alive (its memory goes first) a moment before the kernel has
        # closed its sockets: on a busy machine the start could find its own port still taken.
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(port_in_use(p) for p in self.ports().values()):
            time.sleep(0.05)
        self.start(timeout)

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the server's log."""
        return tail(self.service.log_file, lines)


def render_properties(props: dict[str, str]) -> str:
    """Java properties file text."""
    return "".join(f"{k}={v}\n" for k, v in props.items())


def render_log4j(log: Path, root_level: str, loggers: dict[str, str]) -> str:
    """log4j2 properties text for a Java server: every line to the file ``log`` at ``root_level``,
    ``loggers`` (logger name -> level) overriding it."""
    lines = ["status = warn", "appender.file.type = File", "appender.file.name = file", f"appender.file.fileName = {log}",
             "appender.file.layout.type = PatternLayout", "appender.file.layout.pattern = [%d] %p %m (%c)%n",
             f"rootLogger.level = {root_level}", "rootLogger.appenderRef.file.ref = file"]
    for i, (name, level) in enumerate(loggers.items()):
        lines += [f"logger.l{i}.name = {name}", f"logger.l{i}.level = {level}"]
    return "\n".join(lines) + "\n"
