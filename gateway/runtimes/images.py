"""Task images: built once per build context (its hash), cached by the container engine, shared by every
session and node of a machine; and offline stand-ins for the Debian bases Dockerfiles name.

    tag = await ensure_image(env, engine)      # "localhost/polar-task:<hash>", built or found

A build runs under one machine-wide lock per hash (``fcntl`` on a file in the cache dir), so two nodes
asking for the same image build it once. A build that fails or overruns ``build_timeout_s`` raises
``ImageBuildError`` naming the failing ``STEP n/m`` line: a task error, never a reward.

Where no registry answers, ``FROM debian:bookworm-slim`` (or ``python:3.13-slim-bookworm``, ``ubuntu:24.04``...)
is met by a base built from Debian's packages with mmdebstrap (``build_base``): a ``python:`` stand-in
carries the python its tag names (3.13 is trixie's), an ``ubuntu:`` one is the nearest Debian suite. The
image is labelled as a stand-in and ``polarstream images base NAME`` says so when it makes one.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from schemas import EnvironmentSpec

from .site import SiteSettings, host_site

TAG_REPO = "localhost/polar-task"
STANDIN_LABEL = "io.polarstream.standin"
RECIPE_LABEL = "io.polarstream.standin.recipe"  # what made a stand-in: one made by an older recipe is made again
RECIPE_VERSION = 2  # 2: python stand-ins carry their tag's python and no PEP 668 marker


class ImageBuildError(RuntimeError):
    """A task's image could not be built or found; the message is one line naming the step."""


def engine_argv(engine: str) -> list[str]:
    """The engine's CLI with the OCI runtime that works here: podman's default (crun) cannot run in a
    cgroup-v1/v2 hybrid host, runc can (shared/docs/containers.md); docker chooses its own."""
    exe = shutil.which(engine) or engine
    if Path(exe).name == "podman":
        runtime = os.environ.get("POLAR_OCI_RUNTIME") or ("runc" if shutil.which("runc") else "")
        return [exe, *(["--runtime", runtime] if runtime else [])]
    return [exe]


def context_files(env: EnvironmentSpec) -> dict[str, bytes]:
    """The build context as relative path -> bytes (inline text, or read from ``context_dir``)."""
    if env.context:
        return {rel: text.encode() for rel, text in env.context.items()}
    root = Path(env.context_dir)
    if not (root / "Dockerfile").is_file():
        raise ImageBuildError(f"environment: no Dockerfile in {root}")
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def context_hash(files: dict[str, bytes]) -> str:
    """Content hash of a build context: same files, same image, on any node."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + hashlib.sha256(files[rel]).digest())
    return h.hexdigest()[:20]


def task_tag(files: dict[str, bytes]) -> str:
    """The tag of the image a build context makes: its content and the recipes of its stand-in bases."""
    return f"{TAG_REPO}:{context_hash({**files, **standin_salt(files)})}"


def standin_salt(files: dict[str, bytes]) -> dict[str, bytes]:
    """The recipes of the stand-ins a context builds on, as one more entry of its hash: an image built on
    an older stand-in (a ``python:3.13`` of Debian 12's python 3.11) is not taken for today's."""
    dockerfile = files.get("Dockerfile", b"").decode(errors="replace")
    recipes = [recipe_id(r) for base in from_images(dockerfile) if (r := standin_recipe(base)) is not None]
    return {"\0standin-recipes": "\n".join(recipes).encode()} if recipes else {}


def from_images(dockerfile: str) -> list[str]:
    """The external images a Dockerfile builds on (``FROM x [AS y]``; later stages naming ``y`` skipped)."""
    stages, bases = set(), []
    for m in re.finditer(r"^\s*FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", dockerfile, re.M | re.I):
        image, alias = m.group(1), m.group(2)
        if image.lower() not in stages and image.lower() != "scratch" and "$" not in image:
            bases.append(image)
        if alias:
            stages.add(alias.lower())
    return bases


def failing_step(output: str) -> str:
    """The last ``STEP n/m: ...`` line of a build's output (podman and buildah print one per step)."""
    steps = re.findall(r"^(?:\[\d/\d\] )?STEP (\d+/\d+): (.*)$", output, re.M)
    return f"STEP {steps[-1][0]}: {steps[-1][1][:160]}" if steps else "before its first step"


# ------------------------------------------------------------------------------ offline Debian bases


# The python3 each Debian suite ships, and the Debian suite closest to each Ubuntu release (Ubuntu's
# images carry no python; ours do, for the node's tooling).
DEBIAN_PYTHON = {"bullseye": "3.9", "bookworm": "3.11", "trixie": "3.13"}
UBUNTU_SUITE = {"20.04": "bullseye", "focal": "bullseye", "22.04": "bookworm", "jammy": "bookworm",
                "24.04": "trixie", "noble": "trixie", "latest": "trixie"}
PYTHON_EXTRA = ["python3-pip", "python3-venv", "python-is-python3"]


def standin_recipe(name: str) -> tuple[str, list[str]] | None:
    """(Debian suite, extra packages) to stand in for ``name``, or None when it is not a base we can
    make: ``debian:<suite>[-slim]``, ``python:<version>[-slim][-<suite>]`` (the suite that ships that
    python: 3.13 is trixie's whatever suite the tag names; a version no suite ships has none) and
    ``ubuntu:<release>`` (the Debian suite nearest it)."""
    full = qualified(name)
    if not full.startswith("docker.io/library/"):
        return None  # another registry's or user's image: nothing of Debian's looks like it
    repo, _, tag = full.removeprefix("docker.io/library/").partition(":")
    if repo == "debian":
        suite = ("bookworm" if tag == "latest" else tag).removesuffix("-slim")
        return (suite, []) if suite in DEBIAN_PYTHON else None
    if repo == "ubuntu":
        return (UBUNTU_SUITE[tag], []) if tag in UBUNTU_SUITE else None
    if repo != "python":
        return None
    m = re.fullmatch(r"(?:(3)(?:\.(\d+))?(?:\.\d+)?)?(?:-?slim)?(?:-(\w+))?", "" if tag == "latest" else tag)
    if m is None or (m.group(3) and m.group(3) not in DEBIAN_PYTHON):
        return None  # alpine, windowsservercore, a suite we do not know
    # python-is-python3: the registry's python images answer to ``python`` as well (Dockerfiles and
    # verifiers call it); their pip installs system-wide (build_base removes Debian's PEP 668 marker).
    if m.group(2) is None:  # python:3, python:slim-bookworm: any python 3; the named suite's, else bookworm's
        return m.group(3) or "bookworm", PYTHON_EXTRA
    suite = next((s for s, v in DEBIAN_PYTHON.items() if v == f"3.{m.group(2)}"), None)
    return (suite, PYTHON_EXTRA) if suite else None


def recipe_id(recipe: tuple[str, list[str]]) -> str:
    """The stand-in recipe as its image's label says it: ``2:trixie:python3-pip,...``."""
    return f"{RECIPE_VERSION}:{recipe[0]}:{','.join(recipe[1])}"


def qualified(name: str) -> str:
    """A short name as Docker resolves it (podman alone refuses one): ``debian:bookworm-slim`` is
    docker.io/library/debian:bookworm-slim, ``x/y:t`` docker.io/x/y:t; a first part with a dot or a port,
    or ``localhost``, is a registry already; no tag is ``:latest`` (a digest stays as it is)."""
    first, _, rest = name.partition("/")
    if not rest:
        name = f"docker.io/library/{name}"
    elif not ("." in first or ":" in first or first == "localhost"):
        name = f"docker.io/{name}"
    return name if ":" in name.rsplit("/", 1)[-1] or "@" in name else f"{name}:latest"


async def _run(argv: list[str], timeout_s: float | None = None, log: Path | None = None,
               env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run a command; (exit code, or None on timeout; its combined output, also when it timed out)."""
    with tempfile.TemporaryFile() as out:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=out, stderr=asyncio.subprocess.STDOUT, env=env,
                                                    stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
            rc = proc.returncode
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            try:
                os.killpg(proc.pid, 9)  # the engine's client and whatever build step it started
            except ProcessLookupError:
                pass
            await proc.wait()
            if isinstance(e, asyncio.CancelledError):
                raise
            rc = None
        out.seek(0)
        text = out.read().decode(errors="replace")
    if log is not None:
        with open(log, "a") as f:
            f.write(text)
    return rc, text


async def image_exists(engine: str, name: str) -> bool:
    rc, _ = await _run([*engine_argv(engine), "image", "exists" if "podman" in engine else "inspect", name])
    return rc == 0


async def build_base(name: str, engine: str = "podman", *, log: Path | None = None) -> str:
    """Build a Debian stand-in for ``name`` with mmdebstrap and import it under that name; its tag."""
    recipe = standin_recipe(name)
    if recipe is None:
        raise ImageBuildError(f"{name}: no offline stand-in for it (only debian:<suite>, ubuntu:<release> and "
                              "python:<version> of a Debian suite's python)")
    if not shutil.which("mmdebstrap"):
        raise ImageBuildError(f"{name}: cannot build an offline stand-in: mmdebstrap is not installed")
    suite, extra = recipe
    tag = qualified(name)
    # python3 for the node's tunnel-free tooling and Harbor verifiers; bash, procps and ca-certificates
    # as the real slim images have them; libstdc++ comes with apt (the harness's Node needs it).
    packages = ["python3", "ca-certificates", "procps", *extra]
    with tempfile.TemporaryDirectory(prefix="polar-base-", dir=_scratch_dir()) as tmp:
        tar = Path(tmp) / "rootfs.tar"
        # the registry's python images have no PEP 668 marker: their pip installs
        no_marker = ['rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED'] if "python3-pip" in extra else []
        try:
            await debian_rootfs(suite, packages, tar, log=log, customize=no_marker)
        except ImageBuildError as e:
            raise ImageBuildError(f"{name}: {e}") from None
        changes = ["--change", "CMD [\"bash\"]", "--change", f"LABEL {STANDIN_LABEL}=debian-{suite}-minbase",
                   "--change", f"LABEL {RECIPE_LABEL}={recipe_id(recipe)}"]
        rc, out = await _run([*engine_argv(engine), "import", *changes, str(tar), tag], 300, log)
        if rc != 0:
            raise ImageBuildError(f"{name}: importing the stand-in failed: {out.strip()[-200:]}")
    return tag


async def debian_rootfs(suite: str, packages: list[str], tar: Path, *, log: Path | None = None,
                        customize: list[str] = (), epoch: int | None = None) -> None:
    """A Debian ``suite`` minbase rootfs with ``packages`` as the tar file ``tar`` (mmdebstrap, from the
    .deb cache where it holds them); ``epoch``: SOURCE_DATE_EPOCH, mmdebstrap's reproducible mode (the
    same packages give the same tar). ``customize``: more --customize-hook shell lines."""
    debs = deb_cache(suite)
    scratch = _scratch_dir()
    # The .debs are downloads: kept between builds (sync-in/out, mmdebstrap(1)'s cache recipe), and never
    # left in the image. dpkg's fsyncs and the chroot's removal dominate on a disk mounted with discard
    # (100 s against 39 s on this machine), so the chroot lives in RAM where there is room for it.
    cache = ["--skip=download/empty", "--skip=essential/unlink",
             '--setup-hook=mkdir -p "$1"/var/cache/apt/archives/',
             f"--setup-hook=sync-in {debs} /var/cache/apt/archives/",
             f"--customize-hook=sync-out /var/cache/apt/archives {debs}",
             '--customize-hook=rm -f "$1"/var/cache/apt/archives/*.deb',
             *(f"--customize-hook={hook}" for hook in customize)]
    env = {**os.environ, **({"TMPDIR": str(scratch)} if scratch else {}),
           **({"SOURCE_DATE_EPOCH": str(epoch)} if epoch is not None else {})}
    rc, out = await _run(["mmdebstrap", "--quiet", "--variant=minbase", "--dpkgopt=force-unsafe-io", *cache,
                          f"--include={','.join(packages)}", suite, str(tar)], 900, log, env=env)
    if rc != 0:
        raise ImageBuildError(f"mmdebstrap {suite} failed: {out.strip()[-200:]}")


# ----------------------------------------------------------------------------------- task images


class _MachineLock:
    """An exclusive lock on a file, held across processes (nodes) of one machine."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path

    async def __aenter__(self):
        self.f = open(self.path, "a")
        while True:
            try:
                fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                await asyncio.sleep(0.2)

    async def __aexit__(self, *exc):
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def _cache_root() -> Path:
    return Path(os.environ.get("POLAR_CACHE_DIR") or Path.home() / ".cache" / "polarstream")


def lock_dir() -> Path:
    return _cache_root() / "images"


def deb_cache(suite: str) -> Path:
    """Where a stand-in's downloaded .debs are kept (a download cache, like pip's: ``debs`` beside it)."""
    path = _cache_root() / "debs" / suite
    path.mkdir(parents=True, exist_ok=True)
    return path


def _scratch_dir(need_bytes: int = 2 << 30) -> str | None:
    """/dev/shm when it is writable and has room for a chroot (about 250 MB, with margin), else the default."""
    try:
        st = os.statvfs("/dev/shm")
        return "/dev/shm" if os.access("/dev/shm", os.W_OK) and st.f_bavail * st.f_frsize >= need_bytes else None
    except OSError:
        return None


async def ensure_base(name: str, engine: str, log: Path | None = None, *, pull: bool = True) -> str:
    """``name`` present locally: found, pulled, or (no registry) built as a Debian stand-in (again, when
    the one present was made by an older recipe: a ``python:3.13`` stand-in of Debian 12's python 3.11);
    ``pull=False`` when its registry is known not to answer (image_source.py), so no pull waits on it again."""
    if (await image_exists(engine, name) or await image_exists(engine, qualified(name))) and not await stale_standin(engine, name):
        return name
    async with _MachineLock(lock_dir() / f"base-{hashlib.sha256(name.encode()).hexdigest()[:16]}.lock"):
        if await image_exists(engine, qualified(name)) and not await stale_standin(engine, name):
            return name
        rc, out = await _run([*engine_argv(engine), "pull", "-q", qualified(name)], 600, log) if pull else (1, "not pulled")
        if rc == 0:
            return name
        if standin_recipe(name) is None:
            raise ImageBuildError(f"cannot pull {name} ({out.strip().splitlines()[-1][:160] if out.strip() else 'timed out'})"
                                  " and no offline stand-in exists for it")
        await build_base(name, engine, log=log)
        return name


async def stale_standin(engine: str, name: str) -> bool:
    """Whether ``name`` is a stand-in of ours whose recipe is not today's (a pulled image never is)."""
    fmt = f'{{{{index .Labels "{STANDIN_LABEL}"}}}}|{{{{index .Labels "{RECIPE_LABEL}"}}}}'
    rc, out = await _run([*engine_argv(engine), "image", "inspect", "--format", fmt, qualified(name)])
    standin, _, made_by = out.strip().partition("|")
    recipe = standin_recipe(name)
    return rc == 0 and standin not in ("", "<no value>") and recipe is not None and made_by != recipe_id(recipe)


async def ensure_image(env: EnvironmentSpec, engine: str = "podman", *, log: Path | None = None,
                       site: SiteSettings | None = None) -> tuple[str, float]:
    """The image a task runs in, built when its context's image is not there yet; (tag, build seconds).
    ``site``: the CA, proxy and index settings its RUN steps get (None: this host's, site.py)."""
    if env.image:
        return await ensure_base(env.image, engine, log), 0.0
    files = context_files(env)
    tag = task_tag(files)
    if await image_exists(engine, tag):
        return tag, 0.0
    t0 = time.monotonic()
    async with _MachineLock(lock_dir() / f"{tag.rsplit(':', 1)[1]}.lock"):
        if await image_exists(engine, tag):  # another node built it while we waited
            return tag, time.monotonic() - t0
        dockerfile = files["Dockerfile"].decode(errors="replace")
        for base in from_images(dockerfile):
            await ensure_base(base, engine, log)
        site = await asyncio.to_thread(host_site) if site is None else site
        with tempfile.TemporaryDirectory(prefix="polar-ctx-") as tmp, tempfile.TemporaryDirectory(prefix="polar-site-") as site_tmp:
            for rel, data in files.items():
                path = Path(tmp) / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
            remaining = env.build_timeout_s - (time.monotonic() - t0)
            rc, out = await _run([*engine_argv(engine), "build", "--network", "host", "--label", "io.polarstream.task-image=1",
                                  *site.build_args(Path(site_tmp), mounts=Path(engine).name == "podman"), "-t", tag, tmp], max(remaining, 1.0), log)
        if rc is None:
            raise ImageBuildError(f"image build exceeded build_timeout_sec={env.build_timeout_s:g} at {failing_step(out)}")
        if rc != 0:
            raise ImageBuildError(f"image build failed at {failing_step(out)}: {_last_error(out)}")
    return tag, time.monotonic() - t0


def _last_error(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.lower().startswith(("error", "e:"))]
    last = errors[-1] if errors else lines[-1] if lines else "no output"
    return re.sub(r'^Error: building at STEP "[^"]*": ', "", last)[:200]  # the step is named already
