"""Which commit a results file measured, and what changed in the measured code since.

A number describes the code it ran on. ``commit_info`` records that code (commit, and whether the tree
had uncommitted changes); ``changed_since`` lists the measured packages whose files differ between that
commit and the working tree now (committed or not, untracked included), so a page rendered from an old
results file says which of its numbers may no longer describe the code.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The code the benchmarks measure. bench/results/ is their output, not code, so it never counts.
MEASURED = ("gateway/", "streams/", "trainer/", "producers/", "engine/", "schemas/", "bench/")
EXCLUDE = (":(exclude)bench/results",)


def git(args: list[str], root: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)


def commit_info(root: Path = ROOT) -> dict:
    """HEAD and the uncommitted changes (tracked or not, outside bench/results and docs) at measuring time."""
    head = git(["rev-parse", "HEAD"], root)
    status = git(["status", "--porcelain", "--", ".", *EXCLUDE, ":(exclude)docs"], root)
    dirty = [line[3:] for line in status.stdout.splitlines() if line.strip()]
    full = head.stdout.strip() if head.returncode == 0 else None
    return {"git_commit": full[:12] if full else None, "git_commit_full": full,
            "git_dirty": bool(dirty), "git_dirty_files": dirty[:50], "git_dirty_count": len(dirty)}


def changed_since(commit: str | None, root: Path = ROOT) -> dict:
    """Measured files and packages that differ between ``commit`` and the working tree.

    ``known`` is False when the commit is absent or not in this repository: then nothing can be said,
    and the caller must treat the numbers as stale.
    """
    if not commit or git(["cat-file", "-e", f"{commit}^{{commit}}"], root).returncode != 0:
        return {"commit": commit, "known": False, "files": [], "packages": list(MEASURED)}
    spec = ["--", *MEASURED, *EXCLUDE]
    diff = git(["diff", "--name-only", commit, *spec], root)  # commit vs working tree: committed + uncommitted
    new = git(["ls-files", "--others", "--exclude-standard", *spec], root)  # untracked files git diff cannot see
    files = sorted(set(diff.stdout.split()) | set(new.stdout.split()))
    packages = [p for p in MEASURED if any(f.startswith(p) for f in files)]
    return {"commit": commit, "known": True, "files": files, "packages": packages}
