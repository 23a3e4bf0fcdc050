"""Which code each benchmark measured, and whether that code has changed since.

A number describes the code it ran on, and only that code: the publisher's figures do not go stale when
the chaos bench changes. So each benchmark declares its inputs, ``MEASURES = ("producers/", ...)`` at the
top of ``bench/NAME.py`` (packages or files); the script itself and the ``bench._*`` helpers it imports
count too (``declared_inputs``). ``inputs_hash`` hashes the content of those files in the working tree,
committed or not, and each results entry keeps it with the commit it ran at (``bench_provenance``).
``changed_for`` says whether an entry's inputs differ now, and which files: ``make bench`` reruns only
the benchmarks whose inputs changed, and every rendered figure states its own commit and staleness.
"""

from __future__ import annotations

import ast
import hashlib
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Everything a benchmark might measure: the inputs of an entry recorded before benchmarks declared theirs.
MEASURED = ("gateway/", "streams/", "trainer/", "producers/", "engine/", "schemas/", "infra/", "bench/")
EXCLUDE = (":(exclude)bench/results",)  # the benchmarks' output, never code


def git(args: list[str], root: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)


def commit_info(root: Path = ROOT, paths: tuple[str, ...] = (".",)) -> dict:
    """HEAD and the uncommitted changes under ``paths`` (tracked or not; never bench/results or docs)."""
    head = git(["rev-parse", "HEAD"], root)
    status = git(["status", "--porcelain", "--", *paths, *EXCLUDE, ":(exclude)docs"], root)
    dirty = [line[3:] for line in status.stdout.splitlines() if line.strip()]
    full = head.stdout.strip() if head.returncode == 0 else None
    return {"git_commit": full[:12] if full else None, "git_commit_full": full,
            "git_dirty": bool(dirty), "git_dirty_files": dirty[:50], "git_dirty_count": len(dirty)}


def _bench_imports(path: Path) -> tuple[tuple[str, ...], set[str]]:
    """(MEASURES, the bench._* modules imported) of one script, read without importing it."""
    measures: tuple[str, ...] = ()
    helpers: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MEASURES" for t in node.targets):
            measures = tuple(ast.literal_eval(node.value))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench._"):
            helpers.add(node.module)
        elif isinstance(node, ast.Import):
            helpers |= {a.name for a in node.names if a.name.startswith("bench._")}
    return measures, helpers


def declared_inputs(script: Path, root: Path = ROOT) -> tuple[str, ...]:
    """A benchmark's inputs: its MEASURES, the script, and the bench helpers it imports (transitively)."""
    measures, todo = _bench_imports(script)
    seen: set[str] = set()
    while todo:
        module = todo.pop()
        path = root / (module.replace(".", "/") + ".py")
        if module in seen or not path.exists():
            continue
        seen.add(module)
        todo |= _bench_imports(path)[1]
    here = script.resolve()
    own = str(here.relative_to(root.resolve())) if here.is_relative_to(root.resolve()) else str(here)
    return tuple(sorted({*measures, own, *(m.replace(".", "/") + ".py" for m in seen)}))


def inputs_hash(inputs: tuple[str, ...] | list[str], root: Path = ROOT) -> str:
    """A hash of the content of every file under ``inputs`` in the working tree (tracked or untracked,
    not ignored): equal exactly when the measured code is the same, whatever was committed."""
    outside = [p for p in inputs if Path(p).is_absolute()]  # a script outside the repository (a test's bench dir)
    inside = [p for p in inputs if p not in outside]
    listed = git(["ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *inside, *EXCLUDE], root)
    h = hashlib.sha256()
    for rel in sorted(set(filter(None, listed.stdout.split("\0"))) | set(outside)):
        path = root / rel
        if path.is_file():  # a tracked file deleted in the tree is simply absent from the hash
            h.update(rel.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:16]


def bench_provenance(script: Path, root: Path = ROOT) -> dict:
    """What one benchmark measures now: its commit, inputs, their hash and their uncommitted files."""
    inputs = declared_inputs(script, root)
    info = commit_info(root, inputs)
    return {"git_commit": info["git_commit"], "git_commit_full": info["git_commit_full"], "git_dirty": info["git_dirty"],
            "git_dirty_files": info["git_dirty_files"][:20], "inputs": list(inputs), "inputs_hash": inputs_hash(inputs, root)}


def changed_since(commit: str | None, root: Path = ROOT, inputs: tuple[str, ...] | list[str] = MEASURED) -> dict:
    """Files under ``inputs`` that differ between ``commit`` and the working tree, and the inputs they fall in.

    ``known`` is False when the commit is absent or not in this repository: then nothing can be said,
    and the caller must treat the numbers as stale.
    """
    inputs = list(inputs)
    if not commit or git(["cat-file", "-e", f"{commit}^{{commit}}"], root).returncode != 0:
        return {"commit": commit, "known": False, "files": [], "packages": inputs}
    spec = ["--", *inputs, *EXCLUDE]
    diff = git(["diff", "--name-only", commit, *spec], root)  # commit vs working tree: committed + uncommitted
    new = git(["ls-files", "--others", "--exclude-standard", *spec], root)  # untracked files git diff cannot see
    files = sorted(set(diff.stdout.split()) | set(new.stdout.split()))
    packages = [p for p in inputs if any(f == p or f.startswith(p.rstrip("/") + "/") for f in files)]
    return {"commit": commit, "known": True, "files": files, "packages": packages}


def entry_provenance(entry: dict, run: dict) -> dict:
    """An entry's own provenance; one recorded before entries had it inherits the run's commit."""
    if entry.get("provenance"):
        return entry["provenance"]
    m = run.get("machine", {})
    return {"git_commit": m.get("git_commit"), "git_commit_full": m.get("git_commit_full"),
            "git_dirty": m.get("git_dirty", False), "date": m.get("date")}


def changed_for(name: str, entry: dict, run: dict, root: Path = ROOT) -> dict:
    """``changed_since`` for one benchmark's entry, over its own inputs, plus ``stale``.

    With a recorded inputs hash, the hash decides (so code measured uncommitted, then committed as it was,
    is not stale); the files listed are those that differ from the commit it ran at. An entry without one
    is judged by the inputs its script declares today.
    """
    prov = entry_provenance(entry, run)
    script = root / "bench" / f"{name}.py"
    inputs = prov.get("inputs") or (declared_inputs(script, root) if script.exists() else MEASURED)
    out = changed_since(prov.get("git_commit_full") or prov.get("git_commit"), root, inputs)
    if prov.get("inputs_hash"):
        out["stale"] = inputs_hash(inputs, root) != prov["inputs_hash"]
        if not out["stale"]:
            out.update(known=True, files=[], packages=[])
    else:
        out["stale"] = bool(out["files"]) or not out["known"] or bool(prov.get("git_dirty"))
    return out
