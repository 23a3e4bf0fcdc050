"""INIT: every workspace source, path-escape refusal, prepare retries."""

from __future__ import annotations

import io
import subprocess
import tarfile
import zipfile

import pytest

from gateway.node.workspace import WorkspaceError, materialize, prepare
from gateway.runtimes import SubprocessRuntime
from schemas import WorkspaceSpec


async def test_files_dir_and_extra_files(tmp_path):
    await materialize(WorkspaceSpec(kind="files", files={"a.txt": "A", "sub/b.txt": "B"}), tmp_path / "w1")
    assert (tmp_path / "w1" / "sub" / "b.txt").read_text() == "B"
    await materialize(WorkspaceSpec(kind="dir", source=str(tmp_path / "w1"), files={"c.txt": "C"}), tmp_path / "w2")
    assert sorted(p.name for p in (tmp_path / "w2").rglob("*.txt")) == ["a.txt", "b.txt", "c.txt"]


async def test_git_clone_at_ref(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t", *a], check=True, capture_output=True)
    git("init", "-q")
    (repo / "f.txt").write_text("v1")
    git("add", ".")
    git("commit", "-qm", "v1")
    git("tag", "v1")
    (repo / "f.txt").write_text("v2")
    git("commit", "-qam", "v2")
    await materialize(WorkspaceSpec(kind="git", source=str(repo), ref="v1"), tmp_path / "w")
    assert (tmp_path / "w" / "f.txt").read_text() == "v1"
    with pytest.raises(WorkspaceError, match="git clone failed"):
        await materialize(WorkspaceSpec(kind="git", source=str(tmp_path / "missing")), tmp_path / "w2")


async def test_archives_and_escapes(tmp_path):
    tgz = tmp_path / "src.tar.gz"
    with tarfile.open(tgz, "w:gz") as tf:
        data = b"hello"
        info = tarfile.TarInfo("pkg/hello.txt")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    await materialize(WorkspaceSpec(kind="archive", source=str(tgz)), tmp_path / "w")
    assert (tmp_path / "w" / "pkg" / "hello.txt").read_text() == "hello"
    evil = tmp_path / "evil.zip"
    with zipfile.ZipFile(evil, "w") as zf:
        zf.writestr("../../escaped.txt", "x")
    with pytest.raises(WorkspaceError, match="escapes the workspace"):
        await materialize(WorkspaceSpec(kind="archive", source=str(evil)), tmp_path / "w3")
    assert not (tmp_path / "escaped.txt").exists()
    with pytest.raises(WorkspaceError, match="escapes the workspace"):
        await materialize(WorkspaceSpec(kind="files", files={"ok.txt": "1", "/etc/x": "2"}), tmp_path / "w4")
    assert not (tmp_path / "w4" / "ok.txt").exists()  # nothing written when any path is bad


async def test_prepare_retries_then_fails_clearly(tmp_path):
    ws, home = tmp_path / "ws", tmp_path / "home"
    ws.mkdir()
    home.mkdir()
    # fails twice, then succeeds: a flaky download, say
    flaky = "n=$(cat count 2>/dev/null || echo 0); echo $((n+1)) > count; [ $n -ge 2 ]"
    retries = await prepare([flaky, "touch prepared"], ws, home, SubprocessRuntime(), attempts=3, backoff_s=0.01)
    assert retries == 2 and (ws / "prepared").exists()
    with pytest.raises(WorkspaceError, match=r"'exit 7' failed after 2 attempts \(exit code 7\)"):
        await prepare(["exit 7"], ws, home, SubprocessRuntime(), attempts=2, backoff_s=0.01)
