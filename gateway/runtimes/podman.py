"""The ``podman`` runtime (``docker`` is the same CLI): each session in a container of its task's image.

One container per session, as Harbor runs a trial: created at INIT from the task's image (built once per
Dockerfile content, images.py) and removed at teardown. Prepare commands, the harness, a task's solution
and the verifier all ``exec`` into it, so the verifier sees the agent's final state.

A node keeps a few containers of each shape started ahead of need (prepared.py): one is taken by
exactly one session and removed with it, so a session never sees another's. A verifier's files and the
kill of what the agent left go in one ``exec`` (exec_files.py).

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
import tarfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from schemas import TaskRequest

from .base import ExecResult, ExecSpec, RuntimeUnavailable, _tail, sandbox_port
from .bwrap import HOME, TUNNEL, WORKSPACE
from .image_source import task_image
from .images import ImageBuildError, engine_argv
from .exec_files import NO_TAR, pack, unpack, wrapped
from .prepared import PreparedContainers, StartGate
from .site import host_site, site_mode

log = logging.getLogger("polarstream.node")

OWNER_LABEL = "io.polarstream.owner"
SESSION_LABEL = "io.polarstream.session"
PROCESS_LABEL = "io.polarstream.process"  # "<boot id>:<pid namespace>:<pid>" of the node that made it
NODE_BIN = "/usr/local/bin/node"
IMAGE_KEEP_S = 120.0  # how long a task environment's image, once found or built, is taken as there
RUNC, RUNC_ROOT = shutil.which("runc") or "", "/run/runc"  # runc's state of podman's containers (rootful)
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


@dataclass(frozen=True)
class Shape:
    """What a session container is started with, but for its session's own directories: two sessions
    of one shape can use each other's prepared containers."""

    image: str
    bridged: bool  # started on the engine's bridge (some phase of the session goes outside)
    agent_online: bool  # the agent's phase may reach the outside (the task's allow_internet)
    workdir: str  # "" = the image's WORKDIR
    host_workspace: bool  # a workspace task in the node's image: its workspace bound at ``workdir``
    memory_mb: int | None
    cpus: float | None
    storage: tuple[str, ...]
    ro_paths: tuple[str, ...]
    node: str  # the host's node binary brought in ("" none)
    site: Any = field(compare=False, hash=False)  # the host's CA and proxies (site.py): one per runtime


async def _remove(box: "ContainerSandbox") -> None:
    await box.close()


class ContainerRuntime:
    """Opens a container sandbox per session (``open``); a container runtime runs nothing by itself."""

    persistent = False

    def __init__(self, sock_path: Path | None = None, *, engine: str = "podman", image: str = "", owner: str = "",
                 pids_limit: int = 1024, site_settings: str = "",
                 prepared: int = 0, max_starting: int = 4, starts_per_s: float = 8.0):
        self.name = engine
        # site.py: the host's CA, proxy and index settings go in ("off": not; "": POLAR_SITE_SETTINGS, else auto)
        self.site_settings = site_mode(site_settings)
        self.engine, self.sock_path, self.image, self.pids_limit = engine, sock_path, image, pids_limit
        self.owner = owner or "polarstream"
        self.python = "python3"
        self._storage_quota: bool | None = None  # whether --storage-opt size= works here, asked once
        self._storage_warned = False
        self.gate = StartGate(max_starting, starts_per_s)  # every container start passes it
        # Containers started ahead of need, up to ``prepared`` per shape (0: none, each opened on demand)
        self.prepared = PreparedContainers(self._prepare, _remove, prepared) if prepared > 0 else None
        self._prepared_dir = Path(".")
        self._images: dict[str, tuple[str, float]] = {}  # a task environment's image, and when it was found

    def unavailable(self) -> str:
        """Why this runtime cannot run here ("" when it can)."""
        return "" if shutil.which(self.engine) else (
            f"{self.engine} is not installed (Debian: apt-get install podman runc; `make system` does it)")

    async def open(self, task: TaskRequest, root: Path, ro_paths: list[Path] = (), node_binary: bool = False,
                   log_path: Path | None = None) -> "ContainerSandbox":
        """Build or find the task's image and give the session a container of it, a prepared one
        (prepared.py) where one of its shape is ready, else one started now; RuntimeUnavailable (the
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
            image, built_s = await self._task_image(env, task.task_id, log_path, site)
        elif self.image:
            image, built_s = self.image, 0.0
        else:
            raise RuntimeUnavailable(f"{self.engine}: task {task.task_id} has no image and the node was given no --image")
        node = ""
        if node_binary:
            node = shutil.which("node") or ""
            if not node:
                raise RuntimeUnavailable("the harness needs node on the host to bring into the container")
            node = os.path.realpath(node)
        agent_online = env is not None and env.allow_internet
        shape = Shape(image=image, bridged=agent_online or task.evaluator.network == "host", agent_online=agent_online,
                      workdir=task.workspace.mount or (WORKSPACE if env is None else ""), host_workspace=env is None,
                      memory_mb=env.memory_mb if env is not None else None, cpus=env.cpus if env is not None else None,
                      storage=tuple(storage), ro_paths=tuple(str(p) for p in ro_paths), node=node, site=site)
        box = self.prepared.take(shape) if self.prepared is not None else None
        if box is not None:
            box.adopt(root)
            box.was_prepared = True
        else:
            name = "polar-" + hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
            box = await self._start(shape, root, name, root.name)
        if self.prepared is not None:
            self._prepared_dir = root.parent / ".prepared"  # beside the sessions: a new node's start clears both
            self.prepared.want(shape)
        box.build_s = built_s
        box.open_s = time.monotonic() - t0
        return box

    async def _task_image(self, env, task_id: str, log_path: Path | None, site) -> tuple[str, float]:
        """task_image, its answer kept for ``IMAGE_KEEP_S``: finding an image is an engine call or two
        (0.2–1 s on a loaded host) on every session's path, for an answer that does not change while its
        sessions run (an image removed meanwhile fails its next start with the engine's error)."""
        key = env.model_dump_json()
        found = self._images.get(key)
        if found is not None and time.monotonic() - found[1] < IMAGE_KEEP_S:
            return found[0], 0.0
        image, built_s = await task_image(env, self.engine, task_id=task_id, log_path=log_path, site=site)
        self._images[key] = (image, time.monotonic())
        return image, built_s

    async def _prepare(self, shape: "Shape") -> "ContainerSandbox":
        """A container of ``shape`` for a session not yet here, its directories in a scratch dir of its own."""
        name = f"polar-p{uuid.uuid4().hex[:15]}"
        scratch = self._prepared_dir / name
        scratch.mkdir(parents=True)
        try:
            box = await self._start(shape, scratch, name, "prepared", ahead=True)
            box.owns_scratch = True
            return box
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise

    async def _start(self, shape: "Shape", scratch: Path, name: str, session: str, ahead: bool = False) -> "ContainerSandbox":
        """Start a container of ``shape`` whose HOME (and workspace, for a workspace task) are under ``scratch``."""
        home = scratch / "home"
        home.mkdir(parents=True, exist_ok=True)
        argv = ["run", "-d", "--name", name, "--label", f"{OWNER_LABEL}={self.owner}",
                "--label", f"{SESSION_LABEL}={session}", "--label", f"{PROCESS_LABEL}={owner_process()}",
                "--hostname", "polar-sandbox",
                "--network", "bridge" if shape.bridged else "none",
                "--ulimit", f"nofile={_hard(resource.RLIMIT_NOFILE, 4096)}:{_hard(resource.RLIMIT_NOFILE, 4096)}",
                "--ulimit", f"nproc={_hard(resource.RLIMIT_NPROC, 4096)}:{_hard(resource.RLIMIT_NPROC, 4096)}",
                "--pids-limit", str(self.pids_limit), "-v", f"{home}:{HOME}", "-e", f"HOME={HOME}",
                *shape.site.run_args(scratch)]
        if shape.memory_mb:
            argv += ["--memory", f"{shape.memory_mb}m", "--memory-swap", f"{shape.memory_mb}m"]
        if shape.cpus:
            argv += ["--cpus", f"{shape.cpus:g}"]
        argv += list(shape.storage)
        if shape.host_workspace:
            (scratch / "workspace").mkdir(parents=True, exist_ok=True)
            argv += ["-v", f"{scratch / 'workspace'}:{shape.workdir}"]
        for p in shape.ro_paths:
            argv += ["-v", f"{p}:{p}:ro"]
        if shape.node:
            argv += ["-v", f"{shape.node}:{NODE_BIN}:ro"]
        async with self.gate.start(ahead):
            if Path(self.engine).name == "podman":  # a leftover of an earlier attempt with this root goes in the same call
                argv.insert(2, "--replace")
            else:  # docker has no --replace: one more call
                await _engine(self.engine, "rm", "-f", name)
            # in its scratch dir: the container's conmon inherits the cwd and writes an "oom" file there
            rc, out = await _engine(self.engine, *argv, "--entrypoint", IDLE[0], shape.image, *IDLE[1:], cwd=scratch)
            if rc != 0:
                raise RuntimeUnavailable(f"{self.engine}: cannot start the session container: {out.strip()[-300:]}")
            box = ContainerSandbox(self, name, shape.image, shape.workdir, scratch, 0.0)
            box.scratch = scratch
            box.bridged = box.online = shape.bridged
            box.agent_online = shape.agent_online
            try:  # the session has no sandbox until this returns: nothing else would remove the container
                await box.set_online(shape.agent_online)  # only its idle PID 1 has run: the agent starts offline
                fmt = "{{.State.Pid}}\n{{.Config.WorkingDir}}\n{{.Config.User}}\n{{.Id}}\n{{range .Config.Env}}{{println .}}{{end}}"
                rc, out = await _engine(self.engine, "inspect", "--format", fmt, name)
                lines = out.splitlines() if rc == 0 else []
                box.pid = lines[0].strip() if lines else ""
                image_workdir = lines[1].strip() if len(lines) > 1 else ""
                box.user = lines[2].strip() if len(lines) > 2 else "?"
                box.runc_id = runc_container(self.engine, lines[3].strip() if len(lines) > 3 else "", box.user)
                if shape.workdir and shape.workdir.rstrip("/") != image_workdir.rstrip("/"):  # the image's WORKDIR exists already
                    await _engine(self.engine, "exec", name, "mkdir", "-p", shape.workdir)
            except BaseException:
                await asyncio.shield(box.close())
                raise
        box.workdir = shape.workdir or image_workdir or "/"
        box.image_path = next((ln[5:] for ln in lines[4:] if ln.startswith("PATH=")), "")
        if ahead:
            await box.start_tunnel_ahead()
        return box

    async def discard_prepared(self) -> None:
        """Remove the containers prepared for sessions that will not come (the node stops)."""
        if self.prepared is not None:
            await self.prepared.discard()

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
        self.was_prepared = False  # started before its session came (prepared.py)
        self.owns_scratch = False  # a prepared container's scratch dir: removed with it
        self.scratch = root  # the host dir holding its HOME (and workspace): the session's root, or a prepared one's
        self.user = ""  # the image's USER ("" = root)
        self.tunnel_ahead: asyncio.subprocess.Process | None = None  # the harness run's relay, started early
        self.runc_id = ""  # the container's id where its runs go through runc directly (runc_container)
        self.kill_pending = False  # stop_processes deferred into the next run (run as root)
        self.parts: dict[str, float] = {}  # seconds of each part of the last run with mounts (verify_*_s)

    def adopt(self, root: Path) -> None:
        """Give this prepared container to the session of ``root``: its HOME (and workspace) directories,
        which the container has bound, move into ``root`` (a bind mount follows its directory's rename)."""
        for d in ("home", "workspace"):
            src = self.scratch / d
            if src.is_dir():
                shutil.rmtree(root / d, ignore_errors=True)
                root.mkdir(parents=True, exist_ok=True)
                os.rename(src, root / d)
        self.root = root

    def workspace_view(self, spec_workspace: Path, mount: str = "") -> str:
        return mount or self.workdir

    def home_view(self, spec_home: Path) -> str:
        return HOME

    def gateway_url(self, gateway_port: int) -> str:
        return f"http://127.0.0.1:{sandbox_port(gateway_port)}"

    def command(self, spec: ExecSpec, stdin: bool = False) -> list[str]:
        """``<engine> exec`` of ``spec`` in this session's container, or ``runc exec`` where podman runs it
        with runc (``runc_container``) (pure); ``stdin``: the program reads the caller's stdin."""
        env = dict(spec.env)
        if "PATH" in env and self.image_path:
            parts = env["PATH"].split(":")
            env["PATH"] = ":".join(parts + [p for p in self.image_path.split(":") if p not in parts])
        if self.runc_id:  # runc passes stdin through; its process runs as the container's own user
            return [RUNC, "--root", RUNC_ROOT, "exec", "--cwd", spec.mount or self.workdir,
                    *(a for k, v in sorted(env.items()) for a in ("--env", f"{k}={v}")), self.runc_id, *spec.argv]
        args = [*engine_argv(self.runtime.engine), "exec", *(["-i"] if stdin else []), "-w", spec.mount or self.workdir]
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
        if (spec.mounts or self.kill_pending) and spec.network != "gateway":
            res = await self._run_one_exec(spec, outputs)
            if res is not None:
                return res
        if self.kill_pending:
            await self._stop_now()
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
                                                    stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                                                    cwd=self.scratch)
        try:
            timed_out, _ = await self._within(proc, proc.wait(), spec.limits.timeout_s)
        finally:
            log.close()
            if tunnel is not None:
                tunnel.terminate()
                await tunnel.wait()
        rc = None if timed_out else proc.returncode
        if not timed_out:
            for seen_at, host in outputs.items():
                await self._copy_out(seen_at, host)
        return ExecResult(rc, timed_out, time.monotonic() - t0, _tail(spec.log_path))

    async def _within(self, proc, waiting, timeout_s: float) -> tuple[bool, Any]:
        """(timed out, what ``waiting`` returned): a run's process waited on for at most ``timeout_s``. Past it,
        or cancelled, the run's processes are killed first (never one left behind by a stopped node)."""
        try:
            return False, await asyncio.wait_for(waiting, timeout_s)
        except asyncio.TimeoutError:
            await self._kill(f"a run passed its {timeout_s:g}s limit")  # kills every process of the run
            await proc.wait()
            return True, None
        except asyncio.CancelledError:
            await self._kill("cancelled")
            await proc.wait()
            raise

    async def _run_one_exec(self, spec: ExecSpec, outputs: dict[str, Path]) -> ExecResult | None:
        """``spec`` with its files and a deferred kill in one ``exec`` (exec_files.py); None when the
        image has no tar (nothing ran: the caller copies with the engine's ``cp``). Each part's seconds
        go to ``parts``."""
        t0 = time.monotonic()
        await self.set_online(spec.network == "host" or self.agent_online)
        t1 = time.monotonic()
        inputs = {seen_at: host for seen_at, host in spec.mounts.items() if seen_at not in outputs}
        payload = await asyncio.to_thread(pack, inputs) if inputs else b""
        kill, self.kill_pending = self.kill_pending, False
        argv = self.command(replace(spec, argv=wrapped(spec.argv, kill, inputs, outputs)), stdin=True)  # the inputs' tar
        log = open(spec.log_path, "ab") if spec.log_path else open(os.devnull, "wb")
        t2 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(*argv,
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                    stderr=log, start_new_session=True, cwd=self.scratch)
        try:
            timed_out, done = await self._within(proc, proc.communicate(payload), spec.limits.timeout_s)
        finally:
            log.close()
        out = b"" if timed_out else done[0]
        t3 = time.monotonic()
        if out == NO_TAR:
            return None
        if not timed_out:
            try:
                await asyncio.to_thread(unpack, out, outputs)
            except (tarfile.TarError, OSError) as e:
                raise RuntimeUnavailable(f"cannot copy {', '.join(outputs)} out of the container: {e}") from None
        t4 = time.monotonic()
        self.parts = {"verify_network_s": t1 - t0, "verify_pack_s": t2 - t1, "verify_exec_s": t3 - t2,
                      "verify_unpack_s": t4 - t3}
        return ExecResult(None if timed_out else proc.returncode, timed_out, t3 - t2, _tail(spec.log_path))

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
        if self.user in ("", "root", "0", "0:0"):  # the next run's exec is root's: it kills them first (exec_files.py)
            self.kill_pending = True
            return
        await self._stop_now()

    async def _stop_now(self) -> None:
        self.kill_pending = False
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
        if self.kill_pending:
            await self._stop_now()
        dest.mkdir(parents=True, exist_ok=True)
        rc, out = await _engine(self.runtime.engine, "cp", f"{self.cname}:{self.workdir}/.", str(dest))
        if rc != 0:
            raise RuntimeUnavailable(f"cannot copy the workspace out of the container: {out.strip()[-200:]}")
        return dest

    async def close(self) -> None:
        """Remove the container (its writable layer with it), and its scratch dir if it was prepared."""
        await _engine(self.runtime.engine, "rm", "-f", "-t", "0", self.cname)
        self.dead = self.dead or "closed"
        if self.tunnel_ahead is not None and self.tunnel_ahead.returncode is None:  # never used: the run never came
            self.tunnel_ahead.kill()
            await self.tunnel_ahead.wait()
        self.tunnel_ahead = None
        if self.owns_scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)

    async def _kill(self, why: str) -> None:
        self.dead = why
        await _engine(self.runtime.engine, "rm", "-f", "-t", "0", self.cname)

    async def _copy_in(self, host: Path, seen_at: str) -> None:
        rc, out = await _engine(self.runtime.engine, "cp", f"{host}/.", f"{self.cname}:{seen_at}")
        if rc != 0:
            raise RuntimeUnavailable(f"cannot copy {seen_at} into the container: {out.strip()[-200:]}")

    async def _copy_out(self, seen_at: str, host: Path) -> None:
        await _engine(self.runtime.engine, "cp", f"{self.cname}:{seen_at}/.", str(host))

    async def start_tunnel_ahead(self) -> None:
        """Start the harness run's gateway relay now (tunnel.py ``--when-told``): its interpreter's start
        is then off the run's path; it listens only when the run tells it where."""
        if self.runtime.sock_path is None or not self.pid.isdigit() or self.pid == "0":
            return
        self.tunnel_ahead = await asyncio.create_subprocess_exec(
            sys.executable, "-I", str(TUNNEL), "--netns", f"/proc/{self.pid}/ns/net", "--unix", str(self.runtime.sock_path),
            "--when-told", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.PIPE)

    async def _tunnel(self, spec: ExecSpec) -> asyncio.subprocess.Process:
        """The relay from the container's loopback to the node's gateway socket, run on the host."""
        rt = self.runtime
        if rt.sock_path is None or spec.gateway_port is None:
            raise RuntimeUnavailable(f"{rt.engine}: network='gateway' needs the node's gateway socket and port")
        pid = self.pid
        if not pid.isdigit() or pid == "0" or not Path(f"/proc/{pid}").exists():
            raise RuntimeUnavailable(f"{rt.engine}: the session container is not running (no process {pid or '?'})")
        listen = f"127.0.0.1:{sandbox_port(spec.gateway_port)}"
        proc, self.tunnel_ahead = self.tunnel_ahead, None
        if proc is not None and proc.returncode is None:  # started with the container: told where to listen now
            proc.stdin.write(f"{listen}\n".encode())
            proc.stdin.close()
        else:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", str(TUNNEL), "--netns", f"/proc/{pid}/ns/net", "--unix", str(rt.sock_path),
                "--listen", listen, stdout=asyncio.subprocess.PIPE,
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
def runc_container(engine: str, cid: str, user: str) -> str:
    """``cid`` where this session's runs may ``runc exec`` into the container directly, else "".

    ``podman exec`` is runc's exec behind podman's CLI, its database and a conmon: 0.2 s a call here
    idle, about 1 s on a loaded 2-core host, against 0.05 s for runc's own (the same process spec: the
    container's cgroup, namespaces, capabilities, seccomp and env). Only where podman runs the container
    with runc under runc's default root (its state there says so), and as the image's user when that is
    root (runc takes no user name): anywhere else, podman's exec."""
    argv = engine_argv(engine)
    if not cid or Path(argv[0]).name != "podman" or argv[1:] != ["--runtime", "runc"] or not RUNC:
        return ""
    if user not in ("", "root", "0", "0:0") or not (Path(RUNC_ROOT) / cid / "state.json").exists():
        return ""
    return cid


def bridge_name(engine: str) -> str:
    """The engine's default bridge network (what ``--network bridge`` joins): podman's is "podman"."""
    return "podman" if Path(engine).name == "podman" else "bridge"


async def _engine(engine: str, *args: str, timeout_s: float = 120.0, cwd: Path | None = None) -> tuple[int | None, str]:
    """One engine command; (exit code or None on timeout, combined output)."""
    proc = await asyncio.create_subprocess_exec(*engine_argv(engine), *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL, cwd=cwd)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return None, f"{engine} {args[0]} timed out"
    return proc.returncode, out.decode(errors="replace")


__all__ = ["ContainerRuntime", "ContainerSandbox", "ImageBuildError"]
