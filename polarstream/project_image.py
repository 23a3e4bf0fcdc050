"""The project's own OCI image: one image that runs every component by its ``polarstream`` command.

    tag = build_project_image()        # "localhost/polarstream:<inputs hash>", built offline

Three layers, each built from what is already on this machine (no registry):
- a Debian rootfs made with mmdebstrap (gateway/runtimes/images.py, ``debian_rootfs``) from Debian's packages
  and the .deb cache: python3 (the venv's interpreter), a JRE (Kafka and the S3 server), bubblewrap (a node
  sandboxes its sessions inside its container) and procps;
- the venv: the files the runtime dependencies of the project installed (their RECORD), taken from this
  venv, so the image holds the versions tested here; test-only packages (pytest, atheris, wandb...) stay out;
- the project's tracked files, on the venv's path by a .pth (the project is installed editable here).

Reproducible: the rootfs tar is made with SOURCE_DATE_EPOCH (mmdebstrap's reproducible mode) and kept in
the cache, files go into the build context in sorted order, and ``podman build --timestamp`` gives every
file and the image's created time one fixed time, so the same inputs make the same image id. The tag is a
hash of the inputs: a second build of the same inputs is the engine's cache of identical content.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

REPO = "localhost/polarstream"
SUITE = "bookworm"  # its python3 is 3.11, the venv's
PACKAGES = ("python3", "ca-certificates", "procps", "bubblewrap", "openjdk-17-jre-headless")
EPOCH = 1767225600  # 2026-01-01: every file's time and the image's created time (SOURCE_DATE_EPOCH)
VENV = "/opt/polarstream/venv"
PROJECT = "/opt/polarstream/project"
CACHE = "/opt/polarstream/cache"  # POLAR_CACHE_DIR in the image: the Kafka and S3 servers' jars
JAR_PROFILES = ("kafka", "s3proxy")
LABEL = "io.polarstream.project-image"  # its value: the inputs hash the tag also carries


class ProjectImageError(RuntimeError):
    """The project image could not be built; the message is one line."""


def runtime_dists(root: str = "polarstream") -> dict[str, md.Distribution]:
    """The installed distributions ``root`` needs at run time (its requirements and theirs, no extras),
    by canonical name; ``root`` itself included."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, md.Distribution] = {}
    seen: set[tuple[str, str]] = set()
    todo = [(root, "")]  # (distribution, one of the extras it is asked with; "" for its plain requirements)
    while todo:
        name, extra = todo.pop()
        name = canonicalize_name(name)
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        if name not in found:
            try:
                found[name] = md.distribution(name)
            except md.PackageNotFoundError:
                raise ProjectImageError(f"{name} is required by the project but not installed in {sys.prefix}") from None
        for text in found[name].requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                # torch's CUDA libraries come as cuda-toolkit[cudart,cublas,...]: the extras carry them
                todo += [(req.name, ""), *((req.name, e) for e in req.extras)]
    return found


def venv_files(dists: dict[str, md.Distribution], site: Path) -> dict[str, Path]:
    """The files the runtime distributions installed under ``site`` (site-packages), relative path -> file;
    the project's own install (editable: a finder pointing at this checkout) and bytecode left out (the
    image compiles its own, so the pyc files match the image's file times)."""
    files: dict[str, Path] = {}
    for name, dist in dists.items():
        if name == "polarstream":
            continue
        for rel in dist.files or []:
            path = Path(os.path.normpath(dist.locate_file(rel)))
            try:
                inside = str(path.relative_to(site))
            except ValueError:
                continue  # scripts under bin/ (their shebangs name this venv): the image writes its own entry point
            if "__pycache__" in inside or inside.endswith(".pyc") or not path.is_file():
                continue
            files[inside] = path
    return dict(sorted(files.items()))


def jar_files() -> dict[str, Path]:
    """The Kafka and S3 servers' jars (fetched from Maven Central into the cache, once), relative path under
    the cache -> file; the JVM's class-data archive left out (it belongs to the host's JVM)."""
    from infra.maven import fetch
    from infra.settings import Settings

    settings = Settings()
    files = {}
    for profile in JAR_PROFILES:
        folder = fetch(profile, settings)
        for path in sorted(folder.iterdir()):
            if path.name.endswith(".jar") or path.name == ".complete":
                files[str(path.relative_to(settings.cache_dir))] = path
    return files


def project_files(root: Path) -> list[str]:
    """The project's tracked files (as they are in the working tree), sorted."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, text=True)
    if out.returncode != 0:
        raise ProjectImageError(f"{root}: not a git checkout ({out.stderr.strip()[:120]}): the image holds its tracked files")
    return sorted(f for f in out.stdout.split("\0") if f and (root / f).is_file() and not (root / f).is_symlink())


def dockerfile() -> str:
    py = f"{VENV}/bin/python"
    return f"""\
FROM scratch
ADD rootfs.tar /
COPY venv/ {VENV}/
# Bytecode in unchecked-hash mode: valid whatever the files' times, the same bytes on every build; the venv's
# in a layer of its own, kept when only the project changes. Some packages ship .py files that are not
# Python 3 (templates, test data): compileall fails on them (exit 1), they are never imported, and the rest
# is compiled, so its status is not the build's.
RUN {py} -m compileall -q -j 0 --invalidation-mode unchecked-hash {VENV}/lib > /dev/null; true
COPY cache/ {CACHE}/
COPY project/ {PROJECT}/
RUN {py} -m compileall -q -j 0 --invalidation-mode unchecked-hash {PROJECT} > /dev/null; true
ENV PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 POLAR_DATA_DIR=/var/lib/polarstream POLAR_CACHE_DIR={CACHE} HOME=/root
WORKDIR {PROJECT}
CMD ["polarstream", "--help"]
"""


def _venv_skeleton(ctx: Path, version: str, dists: dict[str, md.Distribution]) -> None:
    """pyvenv.cfg, the interpreter links and the console scripts (``polarstream``, ``torchrun``, ...) of the
    image's venv, written for its path (the scripts here name this venv's python)."""
    venv = ctx / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(f"home = /usr/bin\ninclude-system-site-packages = false\nversion = {version}\n")
    for name in ("python", "python3", f"python{version.rsplit('.', 1)[0]}"):
        (venv / "bin" / name).symlink_to("/usr/bin/python3")
    scripts = {ep.name: ep for dist in dists.values() for ep in dist.entry_points if ep.group == "console_scripts"}
    for name, ep in sorted(scripts.items()):
        head, _, rest = ep.attr.partition(".")
        entry = venv / "bin" / name
        entry.write_text(f"#!{VENV}/bin/python\nimport sys\nfrom {ep.module} import {head}\n"
                         f"sys.exit({head}{'.' + rest if rest else ''}())\n")
        entry.chmod(0o755)


def _link(src: Path, dst: Path) -> None:
    """Hard link (no copy of a 4 GB venv) where the file system allows it, else copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_context(ctx: Path, rootfs: Path, project_root: Path) -> str:
    """Fill the build context ``ctx``; return the hash of every input (the tag)."""
    site = Path(sysconfig.get_paths()["purelib"])
    version = ".".join(map(str, sys.version_info[:2])) + ".0"
    h = hashlib.sha256()
    (ctx / "Dockerfile").write_text(dockerfile())
    h.update(dockerfile().encode())
    _link(rootfs, ctx / "rootfs.tar")
    h.update(b"rootfs\0" + _file_hash(rootfs).encode())
    dists = runtime_dists()
    _venv_skeleton(ctx, version, dists)
    lib = ctx / "venv" / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    for rel, src in venv_files(dists, site).items():
        _link(src, lib / rel)
        h.update(f"venv\0{rel}\0{src.stat().st_size}\0{oct(src.stat().st_mode)}\0{int(src.stat().st_mtime)}\0".encode())
    (lib / "polarstream-project.pth").write_text(PROJECT + "\n")
    for rel, src in jar_files().items():
        _link(src, ctx / "cache" / rel)
        h.update(f"jar\0{rel}\0{src.stat().st_size}\0".encode())
    for rel in project_files(project_root):
        # copied, not linked: a file edited during the build (the checkout is worked in) would change under
        # the hash taken of it; the venv's files are not edited, and are 4 GB
        dst = ctx / "project" / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(project_root / rel, dst)
        h.update(f"project\0{rel}\0".encode() + hashlib.sha256(dst.read_bytes()).digest())
    return h.hexdigest()[:20]


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def rootfs_tar(cache: Path, log: Path | None = None) -> Path:
    """The image's Debian rootfs, made once per package list (mmdebstrap, reproducibly) and kept."""
    import asyncio

    from gateway.runtimes.images import ImageBuildError, debian_rootfs

    key = hashlib.sha256(f"{SUITE}:{','.join(PACKAGES)}:{EPOCH}".encode()).hexdigest()[:16]
    tar = cache / f"rootfs-{SUITE}-{key}.tar"
    if not tar.exists():
        cache.mkdir(parents=True, exist_ok=True)
        part = tar.with_name(tar.stem + ".part.tar")  # mmdebstrap picks its output format by the extension
        try:
            asyncio.run(debian_rootfs(SUITE, list(PACKAGES), part, log=log, epoch=EPOCH))
        except ImageBuildError as e:
            raise ProjectImageError(str(e)) from None
        part.rename(tar)
    return tar


def build_project_image(engine: str = "podman", project_root: Path | None = None, cache: Path | None = None,
                        log: Path | None = None, force: bool = False) -> str:
    """Build (or find) the project image of this checkout and venv; its tag."""
    from gateway.runtimes.images import engine_argv

    if not shutil.which(engine):
        raise ProjectImageError(f"{engine} is not installed (Debian: apt-get install podman runc mmdebstrap; `make system` does it)")
    root = project_root or Path(__file__).resolve().parents[1]
    cache = cache or Path(os.environ.get("POLAR_CACHE_DIR") or Path.home() / ".cache" / "polarstream") / "project-image"
    tar = rootfs_tar(cache, log)
    # the context in the cache: on the venv's file system here, so its files are hard links, not copies
    with tempfile.TemporaryDirectory(prefix="context-", dir=cache) as tmp:
        ctx = Path(tmp)
        tag = f"{REPO}:{write_context(ctx, tar, root)}"
        argv = engine_argv(engine)
        if not force and subprocess.run([*argv, "image", "exists", tag], capture_output=True).returncode == 0:
            return tag
        # --timestamp: every file's and the image's time; and nothing else of the build's own in the config
        # (checked: two builds from nothing give one id): no history (its comments name the intermediate
        # images, whose ids carry the time they were made), no buildah version label, no base-image annotations
        out = subprocess.run([*argv, "build", "--network", "none", "--timestamp", str(EPOCH), "--omit-history",
                              "--identity-label=false", "--annotation", "org.opencontainers.image.base.digest=",
                              "--annotation", "org.opencontainers.image.base.name=", "--label", f"{LABEL}={tag.rsplit(':', 1)[1]}",
                              *(["--no-cache"] if force else []), "-t", tag, "-t", f"{REPO}:latest", str(ctx)],
                             capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if log is not None:
            log.write_text(out.stdout + out.stderr)
        if out.returncode != 0:
            last = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()][-1:] or ["no output"]
            raise ProjectImageError(f"podman build of the project image failed: {last[0][:200]}")
    return tag


def image_id(tag: str, engine: str = "podman") -> str:
    """The image's id (the digest of its config, which names every layer's digest)."""
    from gateway.runtimes.images import engine_argv

    out = subprocess.run([*engine_argv(engine), "image", "inspect", "--format", "{{.Id}}", tag], capture_output=True, text=True)
    if out.returncode != 0:
        raise ProjectImageError(f"no image {tag}: {out.stderr.strip()[:160]}")
    return out.stdout.strip()
