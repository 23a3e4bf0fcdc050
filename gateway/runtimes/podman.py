"""The ``podman`` runtime (``docker`` is the same CLI): each session in a container of its task's image.

One container per session, as Harbor runs a trial: created at INIT from the task's image (built once per
Dockerfile content, images.py) and removed at teardown. Prepare commands, the harness, a task's solution
and the verifier all ``exec`` into it, so the verifier sees the agent's final state.

Inside: the workspace is the image's WORKDIR (``WorkspaceSpec.mount``, /app by default); a workspace
task without an image runs in the node's ``--image`` with its directory bound at /workspace. HOME is
/home/agent, bound from the session's home (the harness's config files). An npm CLI comes in read-only
from the node: its install tree at its host path and the host's ``node`` at /usr/local/bin/node (no
layer to build per image and version; the image needs glibc and libstdc++, as Debian's and Ubuntu's have).

Network, per phase: the agent's runs (harness, prepare, a solution) get none but the gateway unless the
task's ``allow_internet`` is set; a run whose spec asks for ``host`` (a Harbor verifier, by default) gets
the outside world. Outside always means the engine's bridge, never the host's network, whose loopback
holds Kafka and the storage server. One container has both phases, so a container that will need the
bridge starts on it and is disconnected from it at once (before anything but its idle PID 1 runs), and
connected again for the run that asks; ``network connect`` to a container started with ``--network
none`` is refused by the engine. The gateway comes in through tunnel.py, which the node runs on the host
inside the container's network namespace for the length of a harness run: the image needs no python
for it, and the verifier runs after it is gone. ``stop_processes`` ends what the agent left running.

Limits: ``memory_mb`` (swap included), ``cpus``, a pids cap and open files; a run past its deadline
kills the container (the session ends there in any case). ``storage_mb`` is enforced where the engine's
storage can (overlay on xfs mounted with project quotas: ``--storage-opt size=``); elsewhere it is
advisory, said once per runtime (a node has one), never a failure of the session. Each container is
labelled with its owner (the node's work dir), so a restarted node removes what its predecessor left
(``cleanup``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import resource
import shutil
import sys
import time
from pathlib import Path

from schemas import TaskRequest

from .base import ExecResult, ExecSpec, RuntimeUnavailable, _tail, sandbox_port
from .bwrap import HOME, TUNNEL, WORKSPACE
from .image_source import task_image
from .images import ImageBuildError, engine_argv
from .site import host_site, site_mode

log = logging.getLogger("polarstream.node")

OWNER_LABEL = "io.polarstream.owner"
SESSION_LABEL = "io.polarstream.session"
PROCESS_LABEL = "io.polarstream.process"  # "<boot id>:<pid namespace>:<pid>" of the node that made it
NODE_BIN = "/usr/local/bin/node"
# PID 1 of a session container: waits, and exits at once on the engine's stop (any image has /bin/sh).
IDLE = ["/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done"]


def owner_process() -> str:
    """This process as ``PROCESS_LABEL`` names it: a container whose process is gone is an orphan."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}:{pidns}:{os.getpid()}"


def orphaned(label: str, me: str) -> bool:
    """Whether the node named by a container's ``PROCESS_LABEL`` is certainly dead: another boot, or its
    pid gone from our pid namespace (a live pid, perhaps reused, or another namespace: left alone)."""
    theirs, ours = label.split(":"), me.split(":")
    if len(theirs) != 3 or len(ours) != 3 or not theirs[2].isdigit():
        return False
    if theirs[0] != ours[0]:
        return True  # the machine rebooted since: its node is gone
    if theirs[1] != ours[1] or theirs[2] == ours[2]:
        return False
    try:
        os.kill(int(theirs[2]), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _hard(limit: int, want: int) -> int:
    hard = resource.getrlimit(limit)[1]
    return want if hard == resource.RLIM_INFINITY else min(want, hard)


class ContainerRuntime:
    """Opens a container sandbox per session (``open``); a container runtime runs nothing by itself."""

    persistent = False

    def __init__(self, sock_path: Path | None = None, *, engine: str = "podman", image: str = "", owner: str = "",
                 pids_limit: int = 1024, site_settings: str = ""):
        self.name = engine
        # site.py: the host's CA, proxy and index settings go in ("off": not; "": POLAR_SITE_SETTINGS, else auto)
        self.site_settings = site_mode(site_settings)
        self.engine, self.sock_path, self.image, self.pids_limit = engine, sock_path, image, pids_limit
        self.owner = owner or "polarstream"
        self.python = "python3"
        self._storage_quota: bool | None = None  # whether --storage-opt size= works here, asked once
        self._storage_warned = False

    def unavailable(self) -> str:
        """Why this runtime cannot run here ("" when it can)."""
        return "" if shutil.which(self.engine) else (
            f"{self.engine} is not installed (Debian: apt-get install podman runc; `make system` does it)")

    async def open(self, task: TaskRequest, root: Path, ro_paths: list[Path] = (), node_binary: bool = False,
                   log_path: Path | None = None) -> "ContainerSandbox":
        """Build or find the task's image and start its session container; RuntimeUnavailable (the
        engine is missing, a limit cannot be enforced) or ImageBuildError (a task error) otherwise."""
        if why := self.unavailable():
            raise RuntimeUnavailable(why)
        env = task.environment
        if env is not None and env.gpus:
            raise RuntimeUnavailable(f"task {task.task_id} asks for {env.gpus} GPU(s); this node's containers have none")
        t0 = time.monotonic()
        storage = await self._storage_opt(env.storage_mb) if env is not None and env.storage_mb else []
        site = await asyncio.to_thread(host_site, self.site_settings)
        if env is not None:
            image, built_s = await task_image(env, self.engine, task_id=task.task_id, log_path=log_path, site=site)
        elif self.image:
            image, built_s = self.image, 0.0
        else:
            raise RuntimeUnavailable(f"{self.engine}: task {task.task_id} has no image and the node was given no --image")
        home = root / "home"
        home.mkdir(parents=True, exist_ok=True)
        name = "polar-" + hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
        agent_online = env is not None and env.allow_internet
        bridged = agent_online or task.evaluator.network == "host"  # some phase of this session goes outside
        workdir = task.workspace.mount or (WORKSPACE if env is None else "")
        argv = ["run", "-d", "--name", name, "--label", f"{OWNER_LABEL}={self.owner}",
                "--label", f"{SESSION_LABEL}={root.name}", "--label", f"{PROCESS_LABEL}={owner_process()}",
                "--hostname", "polar-sandbox",
                "--network", "bridge" if bridged else "none",
                "--ulimit", f"nofile={_hard(resource.RLIMIT_NOFILE, 4096)}:{_hard(resource.RLIMIT_NOFILE, 4096)}",
                "--ulimit", f"nproc={_hard(resource.RLIMIT_NPROC, 4096)}:{_hard(resource.RLIMIT_NPROC, 4096)}",
                "--pids-limit", str(self.pids_limit), "-v", f"{home}:{HOME}", "-e", f"HOME={HOME}", *site.run_args(root)]
        if env is not None and env.memory_mb:
            argv += ["--memory", f"{env.memory_mb}m", "--memory-swap", f"{env.memory_mb}m"]
        if env is not None and env.cpus:
            argv += ["--cpus", f"{env.cpus:g}"]
        argv += storage
        if env is None:
            (root / "workspace").mkdir(parents=True, exist_ok=True)
            argv += ["-v", f"{root / 'workspace'}:{workdir}"]
        for p in ro_paths:
            argv += ["-v", f"{p}:{p}:ro"]
        if node_binary:
            node = shutil.which("node")
            if node is None:
                raise RuntimeUnavailable("the harness needs node on the host to bring into the container")
            argv += ["-v", f"{os.path.realpath(node)}:{NODE_BIN}:ro"]
        if Path(self.engine).name == "podman":  # a leftover of an earlier attempt with this root goes in the same call
            argv.insert(2, "--replace")
        else:  # docker has no --replace: one more call
            await _engine(self.engine, "rm", "-f", name)
        rc, out = await _engine(self.engine, *argv, "--entrypoint", IDLE[0], image, *IDLE[1:])
        if rc != 0:
            raise RuntimeUnavailable(f"{self.engine}: cannot start the session container: {out.strip()[-300:]}")
        box = ContainerSandbox(self, name, image, workdir, root, built_s)
        box.bridged = box.online = bridged
        box.agent_online = agent_online
        try:  # the session has no sandbox until this returns: nothing else would remove the container
            await box.set_online(agent_online)  # only its idle PID 1 has run: the agent starts offline
            fmt = "{{.State.Pid}}\n{{.Config.WorkingDir}}\n{{range .Config.Env}}{{println .}}{{end}}"
            rc, out = await _engine(self.engine, "inspect", "--format", fmt, name)
            lines = out.splitlines() if rc == 0 else []
            box.pid = lines[0].strip() if lines else ""
            image_workdir = lines[1].strip() if len(lines) > 1 else ""
            if workdir and workdir.rstrip("/") != image_workdir.rstrip("/"):  # the image's WORKDIR exists already
                await _engine(self.engine, "exec", name, "mkdir", "-p", workdir)
        except BaseException:
            await asyncio.shield(box.close())
            raise
        box.workdir = workdir or image_workdir or "/"
        box.image_path = next((ln[5:] for ln in lines[2:] if ln.startswith("PATH=")), "")
        box.open_s = time.monotonic() - t0
        return box

    async def _storage_opt(self, storage_mb: int) -> list[str]:
        """``--storage-opt size=`` where this engine's storage enforces it; else [] and, the first time,
        one warning that the task's storage limit is advisory here."""
        if self._storage_quota is None:
            rc, out = await _engine(self.engine, "info", "--format",
                                    '{{.Store.GraphDriverName}}\t{{index .Store.GraphStatus "Backing Filesystem"}}\t{{.Store.GraphRoot}}')
            driver, fs, root = ((out.strip().split("\t") + ["", "", ""])[:3]) if rc == 0 else ("", "", "")
            self._storage_quota = storage_quota(driver, fs, mount_options(root) if root else "")
            if not self._storage_quota and not self._storage_warned:  # sessions opening at once ask together
                self._storage_warned = True
                log.warning("tasks' storage limits ([environment] storage / storage_mb) are advisory on this node: %s "
                            "storage is %s on %s, and only overlay on xfs mounted with project quotas (prjquota) "
                            "can enforce them", self.engine, driver or "unknown", fs or "an unknown filesystem")
        return ["--storage-opt", f"size={storage_mb}m"] if self._storage_quota else []

    async def cleanup(self, orphans: bool = False) -> int:
        """Remove every container this owner left (a node that died with this work dir) and, with
        ``orphans``, any other whose node is dead (a node of another work dir: by default each node id has
        its own, so a restarted node would never find its predecessor's); how many."""
        if self.unavailable():
            return 0
        fmt = f'{{{{.ID}}}}\t{{{{index .Labels "{OWNER_LABEL}"}}}}\t{{{{index .Labels "{PROCESS_LABEL}"}}}}'
        rc, out = await _engine(self.engine, "ps", "-a", "--filter", f"label={OWNER_LABEL}", "--format", fmt)
        me = owner_process()
        ids = [cid for cid, owner, proc in (((ln.split("\t") + ["", ""])[:3]) for ln in out.splitlines() if ln.strip())
               if owner == self.owner or (orphans and orphaned(proc, me))] if rc == 0 else []
        if ids:
            await _engine(self.engine, "rm", "-f", "-t", "0", *ids)
        return len(ids)


class ContainerSandbox:
    """One session's container: a Runtime whose runs ``exec`` into it, in its current state."""

    persistent = True
    python = "python3"

    def __init__(self, runtime: ContainerRuntime, name: str, image: str, workdir: str, root: Path, build_s: float):
        self.runtime, self.cname, self.image, self.workdir, self.root = runtime, name, image, workdir, root
        self.name = runtime.name
        self.build_s, self.open_s = build_s, 0.0
        self.dead = ""  # why the container is gone (a timeout killed it)
        self.image_path = ""  # the image's own PATH (a venv's bin, say), kept behind the one a run sets
        self.pid = ""  # the container's first process on the host: its network namespace takes the tunnel
        self.bridged = False  # started on the engine's bridge: its runs may be connected to the outside
        self.online = False  # connected to the bridge now
        self.agent_online = False  # the agent's phase may reach the outside (the task's allow_internet)

    def workspace_view(self, spec_workspace: Path, mount: str = "") -> str:
        return mount or self.workdir

    def home_view(self, spec_home: Path) -> str:
        return HOME

    def gateway_url(self, gateway_port: int) -> str:
        return f"http://127.0.0.1:{sandbox_port(gateway_port)}"

    def command(self, spec: ExecSpec) -> list[str]:
        """``<engine> exec`` of ``spec`` in this session's container (pure)."""
        args = [*engine_argv(self.runtime.engine), "exec", "-w", spec.mount or self.workdir]
        env = dict(spec.env)
        if "PATH" in env and self.image_path:
            parts = env["PATH"].split(":")
            env["PATH"] = ":".join(parts + [p for p in self.image_path.split(":") if p not in parts])
        for k, v in sorted(env.items()):
            args += ["-e", f"{k}={v}"]
        return [*args, self.cname, *spec.argv]

    async def run(self, spec: ExecSpec) -> ExecResult:
        """Run ``spec`` in the container: ``mounts`` copied in first and back after (the container
        outlives them); the gateway tunnel up for a ``network="gateway"`` run only."""
        if self.dead:
            raise RuntimeUnavailable(f"{self.runtime.engine}: the session container is gone ({self.dead})")
        # A mount that holds files is an input (tests, a solution) and goes in; an empty one is an output
        # (the verifier's logs) and comes back after the run. The container outlives them both.
        outputs = {seen_at: host for seen_at, host in spec.mounts.items() if not any(Path(host).iterdir())}
        if spec.mounts:
            await _engine(self.runtime.engine, "exec", self.cname, "mkdir", "-p", *spec.mounts)
        for seen_at, host in spec.mounts.items():
            if seen_at not in outputs:
                await self._copy_in(host, seen_at)
        await self.set_online(spec.network == "host" or self.agent_online)
        tunnel = await self._tunnel(spec) if spec.network == "gateway" else None
        log = open(spec.log_path, "ab") if spec.log_path else open(os.devnull, "wb")
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(*self.command(spec), stdin=asyncio.subprocess.DEVNULL, stdout=log,
                                                    stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), spec.limits.timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
        except asyncio.CancelledError:
            await self._kill("cancelled")
            await proc.wait()
            raise
        finally:
            log.close()
            if tunnel is not None:
                tunnel.terminate()
                await tunnel.wait()
        if timed_out:
            await self._kill(f"a run passed its {spec.limits.timeout_s:g}s limit")  # kills every process of the run
            await proc.wait()
        rc = None if timed_out else proc.returncode
        if not timed_out:
            for seen_at, host in outputs.items():
                await self._copy_out(seen_at, host)
        return ExecResult(rc, timed_out, time.monotonic() - t0, _tail(spec.log_path))

    async def set_online(self, online: bool) -> None:
        """Connect the container to the engine's bridge, or disconnect it; RuntimeUnavailable when a run
        asks for the outside and the container was not started on the bridge (its task says no phase needs it)."""
        if online == self.online:
            return
        if online and not self.bridged:
            raise RuntimeUnavailable(f"{self.runtime.engine}: a run asks for the network, but this session's "
                                     "container has none (the task's verifier network is 'none')")
        net = bridge_name(self.runtime.engine)
        rc, out = await _engine(self.runtime.engine, "network", "connect" if online else "disconnect", net, self.cname)
        if rc != 0:
            raise RuntimeUnavailable(f"{self.runtime.engine}: cannot {'connect' if online else 'disconnect'} the "
                                     f"session container {'to' if online else 'from'} {net}: {out.strip()[-200:]}")
        self.online = online

    async def stop_processes(self) -> None:
        """Kill every process in the container but its idle PID 1 (what the agent started and left running):
        ``kill -9 -1`` signals all but PID 1 and the caller, as root whoever the image's user is."""
        if self.dead:
            return
        rc, out = await _engine(self.runtime.engine, "exec", "-u", "0", self.cname, "/bin/sh", "-c", "kill -9 -1 2>/dev/null; true")
        if rc != 0:
            raise RuntimeUnavailable(f"{self.runtime.engine}: cannot stop the agent's processes: {out.strip()[-200:]}")

    async def oom_killed(self) -> bool:
        """Whether the kernel killed a process of this container for its memory limit (cgroup v1 or v2)."""
        rc, out = await _engine(self.runtime.engine, "exec", self.cname, "/bin/sh", "-c",
                                "cat /sys/fs/cgroup/memory/memory.oom_control /sys/fs/cgroup/memory.events 2>/dev/null")
        return any(line.split()[:1] == ["oom_kill"] and line.split()[1] != "0" for line in out.splitlines() if line.strip())

    async def export_workspace(self, dest: Path) -> Path:
        """Copy the container's workspace out to ``dest`` (for evaluators that read files on the host)."""
        dest.mkdir(parents=True, exist_ok=True)
        rc, out = await _engine(self.runtime.engine, "cp", f"{self.cname}:{self.workdir}/.", str(dest))
        if rc != 0:
            raise RuntimeUnavailable(f"cannot copy the workspace out of the container: {out.strip()[-200:]}")
        return dest

    async def close(self) -> None:
        """Remove the container (its writable layer with it)."""
        await _engine(self.runtime.engine, "rm", "-f", "-t", "0", self.cname)
        self.dead = self.dead or "closed"

    async def _kill(self, why: str) -> None:
        self.dead = why
        await _engine(self.runtime.engine, "rm", "-f", "-t", "0", self.cname)

    async def _copy_in(self, host: Path, seen_at: str) -> None:
        rc, out = await _engine(self.runtime.engine, "cp", f"{host}/.", f"{self.cname}:{seen_at}")
        if rc != 0:
            raise RuntimeUnavailable(f"cannot copy {seen_at} into the container: {out.strip()[-200:]}")

    async def _copy_out(self, seen_at: str, host: Path) -> None:
        await _engine(self.runtime.engine, "cp", f"{self.cname}:{seen_at}/.", str(host))

    async def _tunnel(self, spec: ExecSpec) -> asyncio.subprocess.Process:
        """The relay from the container's loopback to the node's gateway socket, run on the host."""
        rt = self.runtime
        if rt.sock_path is None or spec.gateway_port is None:
            raise RuntimeUnavailable(f"{rt.engine}: network='gateway' needs the node's gateway socket and port")
        pid = self.pid
        if not pid.isdigit() or pid == "0" or not Path(f"/proc/{pid}").exists():
            raise RuntimeUnavailable(f"{rt.engine}: the session container is not running (no process {pid or '?'})")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", str(TUNNEL), "--netns", f"/proc/{pid}/ns/net", "--unix", str(rt.sock_path),
            "--listen", f"127.0.0.1:{sandbox_port(spec.gateway_port)}", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL)
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:  # no word in 30 s, or the run cancelled
            proc.kill()
            await proc.wait()
            if isinstance(e, asyncio.CancelledError):
                raise
            raise RuntimeUnavailable("gateway tunnel into the container: no word from it in 30 s") from None
        if line.strip() != b"ready":
            proc.kill()
            rest = line + (await proc.stdout.read())
            raise RuntimeUnavailable(f"gateway tunnel into the container failed: {rest.decode(errors='replace').strip()[-300:]}")
        return proc


def storage_quota(driver: str, backing_fs: str, mount_opts: str) -> bool:
    """Whether ``--storage-opt size=`` is enforced: overlay on xfs with project quotas (podman-run(1))."""
    return driver == "overlay" and backing_fs == "xfs" and bool(set(mount_opts.split(",")) & {"prjquota", "pquota"})


def mount_options(path: str) -> str:
    """The mount options of the filesystem that holds ``path`` (the longest mount point above it)."""
    best, opts = "", ""
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 4 and (path == fields[1] or path.startswith(fields[1].rstrip("/") + "/")) and len(fields[1]) >= len(best):
                best, opts = fields[1], fields[3]
    except OSError:
        pass
    return opts
def bridge_name(engine: str) -> str:
    """The engine's default bridge network (what ``--network bridge`` joins): podman's is "podman"."""
    return "podman" if Path(engine).name == "podman" else "bridge"


async def _engine(engine: str, *args: str, timeout_s: float = 120.0) -> tuple[int | None, str]:
    """One engine command; (exit code or None on timeout, combined output)."""
    proc = await asyncio.create_subprocess_exec(*engine_argv(engine), *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return None, f"{engine} {args[0]} timed out"
    return proc.returncode, out.decode(errors="replace")


__all__ = ["ContainerRuntime", "ContainerSandbox", "ImageBuildError"]
