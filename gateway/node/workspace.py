"""INIT: materialize a session's workspace and run its prepare commands.

Sources (``WorkspaceSpec.kind``): ``empty``, ``dir`` (copied), ``git`` (cloned, optional ref), ``archive``
(.tar[.gz|.bz2|.xz] or .zip, a local path or http(s) URL) and ``files`` (inline path -> content). Every
path that lands in the workspace is checked to stay inside it: archives and inline files come from task
submitters, and ``../`` or absolute names must not write over the node's files.
"""

from __future__ import annotations

import asyncio
import shutil
import tarfile
import tempfile
import zipfile
from pathlib import Path

from gateway.runtimes import ExecSpec, Limits, Runtime, RuntimeUnavailable, command_env
from schemas import WorkspaceSpec


class WorkspaceError(Exception):
    """The workspace could not be built: a task problem (bad source) or an infrastructure one."""


def _inside(root: Path, rel: str) -> Path:
    path = (root / rel).resolve()
    if rel.startswith("/") or not path.is_relative_to(root.resolve()):
        raise WorkspaceError(f"workspace: path {rel!r} escapes the workspace")
    return path


def write_files(root: Path, files: dict[str, str]) -> None:
    """Write inline files; any path outside ``root`` is refused before anything is written."""
    targets = [(_inside(root, rel), content) for rel, content in files.items()]
    for path, content in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)


def extract_archive(archive: Path, root: Path) -> None:
    """Extract a tar or zip archive into ``root``, refusing members that would land outside it."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            for name in zf.namelist():
                _inside(root, name)
            zf.extractall(root)
        return
    try:
        with tarfile.open(archive) as tf:
            tf.extractall(root, filter="data")  # 'data' refuses absolute paths, .., device files, escaping links
    except (tarfile.TarError, OSError) as e:
        raise WorkspaceError(f"workspace.source: cannot extract {archive}: {e}") from None


async def _fetch(url: str, dest: Path) -> Path:
    import httpx

    try:
        async with httpx.AsyncClient(follow_redirects=True, timeout=120) as client:
            async with client.stream("GET", url) as resp:
                resp.raise_for_status()
                with open(dest, "wb") as f:
                    async for chunk in resp.aiter_bytes():
                        f.write(chunk)
    except httpx.HTTPError as e:
        raise WorkspaceError(f"workspace.source: cannot download {url}: {e}") from None
    return dest


async def _git(*args: str, cwd: Path | None = None) -> None:
    proc = await asyncio.create_subprocess_exec("git", *args, cwd=cwd, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise WorkspaceError(f"workspace: git {args[0]} failed: {out.decode(errors='replace').strip()[-300:]}")


async def materialize(spec: WorkspaceSpec, root: Path) -> None:
    """Build the workspace described by ``spec`` at ``root`` (created; must not exist or be empty)."""
    root.mkdir(parents=True, exist_ok=True)
    if spec.kind == "empty":
        pass
    elif spec.kind == "files":
        write_files(root, spec.files)
    elif spec.kind == "dir":
        src = Path(spec.source)
        if not src.is_dir():
            raise WorkspaceError(f"workspace.source: {spec.source!r} is not a directory")
        await asyncio.to_thread(shutil.copytree, src, root, symlinks=True, dirs_exist_ok=True)
    elif spec.kind == "git":
        if not spec.source:
            raise WorkspaceError("workspace.source: a git workspace needs a repository URL or path")
        await _git("clone", "--quiet", spec.source, str(root))
        if spec.ref:
            await _git("checkout", "--quiet", spec.ref, cwd=root)
    elif spec.kind == "archive":
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(spec.source)
            if spec.source.startswith(("http://", "https://")):
                src = await _fetch(spec.source, Path(tmp) / "archive")
            elif not src.is_file():
                raise WorkspaceError(f"workspace.source: archive {spec.source!r} not found")
            await asyncio.to_thread(extract_archive, src, root)
    if spec.files and spec.kind != "files":
        write_files(root, spec.files)  # inline files on top of any source (e.g. a test file)


async def prepare(commands: list[str], workspace: Path, home: Path, runtime: Runtime, *, attempts: int = 3,
                  timeout_s: float = 300.0, backoff_s: float = 1.0, log_path: Path | None = None, mount: str = "") -> int:
    """Run prepare commands in order, each retried up to ``attempts`` times with exponential backoff.

    Returns the number of retries used; raises WorkspaceError when a command keeps failing.
    """
    retries = 0
    env = command_env(runtime, home)
    for cmd in commands:
        for attempt in range(attempts):
            spec = ExecSpec(argv=["/bin/sh", "-c", cmd], env=env, workspace=workspace, home=home,
                            limits=Limits(timeout_s=timeout_s), network="none", log_path=log_path, mount=mount)
            try:
                res = await runtime.run(spec)
            except RuntimeUnavailable as e:
                raise WorkspaceError(f"prepare: runtime unavailable: {e}") from None
            if res.returncode == 0:
                break
            if attempt + 1 == attempts:
                why = "timed out" if res.timed_out else f"exit code {res.returncode}"
                raise WorkspaceError(f"prepare: {cmd!r} failed after {attempts} attempts ({why}): {res.output_tail[-300:]}")
            retries += 1
            await asyncio.sleep(backoff_s * 2**attempt)
    return retries
