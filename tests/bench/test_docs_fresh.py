"""One source of numbers: every marked figure in README.md and docs/*.md is what bench/results/latest.json renders,
and the staleness list names measured code changed since the benchmarked commit.

The freshness test re-renders copies of the pages from the committed latest.json and compares: a figure typed
by hand between ``<!-- bench:... -->`` markers, or a page not re-rendered after a new run, fails it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from bench import run_all
from bench._provenance import changed_since, commit_info
from bench.render import MARKER, pages, render_docs, render_into, render_markers

ROOT = Path(__file__).resolve().parents[2]
LATEST = ROOT / "bench/results/latest.json"


def copy_pages(dst: Path) -> list[Path]:
    out = []
    for page in pages(ROOT):
        target = dst / page.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(page, target)
        out.append(target)
    return out


def test_every_marked_figure_is_what_latest_json_renders(tmp_path):
    run = json.loads(LATEST.read_text())
    m = run["machine"]
    stale = changed_since(m.get("git_commit_full") or m.get("git_commit"), ROOT)
    copies = copy_pages(tmp_path)
    render_docs(run, tmp_path, stale=stale)
    stale_pages = [str(c.relative_to(tmp_path)) for c in copies if c.read_text() != (ROOT / c.relative_to(tmp_path)).read_text()]
    assert not stale_pages, (f"{stale_pages} differ from what bench/results/latest.json renders (a hand-typed figure inside "
                             "a marker, or pages not re-rendered): run .venv/bin/python bench/run_all.py --render-only")
    assert sum(len(MARKER.findall(c.read_text())) for c in copies) >= 10  # the docs really are marked


def test_a_hand_typed_figure_inside_a_marker_is_replaced():
    run = {"mode": "full", "machine": {"git_commit": "abc123", "date": "2026-01-01"},
           "benchmarks": {"streams": {"status": "ok", "result": {"worker": {"burst": {"calls_per_s": 304.8}}}}}}
    page = "worker: <!-- bench:streams:worker/burst/calls_per_s -->101<!-- /bench --> calls/s"
    assert render_markers(page, run, None) == "worker: <!-- bench:streams:worker/burst/calls_per_s -->304.8<!-- /bench --> calls/s"
    missing = render_markers("<!-- bench:streams:worker/none -->7<!-- /bench -->", run, None)
    assert "7" not in missing and "not in latest.json" in missing


def test_a_figure_marked_after_the_results_section_leaves_the_section_alone(tmp_path):
    run = {"mode": "full", "machine": {"git_commit": "abc123", "date": "2026-01-01"},
           "benchmarks": {"streams": {"status": "ok", "result": {"worker": {"burst": {"calls_per_s": 304.8}}}}}}
    doc = tmp_path / "benchmarks.md"
    doc.write_text("intro\n<!-- bench:results:start -->\nold\n<!-- bench:results:end -->\n"
                   "after: <!-- bench:streams:worker/burst/calls_per_s -->1<!-- /bench -->\n")
    render_into(doc, run, None)
    text = doc.read_text()
    assert "## Results (full run)" in text and "<!-- bench:results:end -->" in text and "old" not in text
    assert "after: <!-- bench:streams:worker/burst/calls_per_s -->304.8<!-- /bench -->" in text


def test_tables_end_with_the_commit_and_what_changed_since():
    run = {"mode": "full", "machine": {"git_commit": "abc123", "git_dirty": True, "date": "2026-01-01"},
           "benchmarks": {"rollout": {"status": "ok", "result": {"kind": "simulation", "comparisons": [
               {"area": "Rollout", "metric": "m", "ours": 2, "anchor": 1, "anchor_name": "a"}]}}}}
    stale = {"known": True, "packages": ["gateway/"], "files": ["gateway/app.py"]}
    out = render_markers("<!-- bench:rollout:comparisons --><!-- /bench -->", run, stale)
    assert "measured at `abc123` **(dirty: uncommitted changes)**" in out and "changed since: `gateway/`" in out
    assert "**Rollout [simulation]**" in out and "ours 2.00× better" in out
    clean = render_markers("<!-- bench:rollout:provenance --><!-- /bench -->", dict(run, machine={"git_commit": "abc"}),
                           {"known": True, "packages": [], "files": []})
    assert "changed since: nothing" in clean and "dirty" not in clean


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def clone(tmp_path) -> Path:
    """A clone of this repository with one commit of its own on top: the 'benchmarked' commit."""
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "--quiet", "--local", "--no-hardlinks", str(ROOT), str(repo)], check=True)
    git(repo, "config", "user.email", "bench@test")
    git(repo, "config", "user.name", "bench test")
    (repo / "bench/results").mkdir(parents=True, exist_ok=True)
    (repo / "bench/results/note.txt").write_text("a results file\n")
    git(repo, "add", "bench/results/note.txt")
    git(repo, "commit", "--quiet", "-m", "benchmarked commit")
    return repo


def test_an_edit_in_gateway_appears_in_the_staleness_list(clone, capsys):
    head = git(clone, "rev-parse", "HEAD")
    info = commit_info(clone)
    assert info["git_commit_full"] == head and info["git_dirty"] is False
    run = {"machine": {"git_commit": head[:12], "git_commit_full": head, "git_dirty": False}}
    assert changed_since(head, clone) == {"commit": head, "known": True, "files": [], "packages": []}
    assert run_all.staleness(run, clone) == 0

    # Output and prose are not measured code: neither makes the numbers stale.
    (clone / "bench/results/note.txt").write_text("a new run\n")
    (clone / "docs/gateway.md").write_text("prose\n")
    assert changed_since(head, clone)["files"] == []

    gateway_file = next(p for p in sorted((clone / "gateway").glob("*.py")))
    gateway_file.write_text(gateway_file.read_text() + "\n# edited after the benchmark\n")
    (clone / "streams/new_module.py").write_text("x = 1\n")  # untracked: git diff alone would miss it
    stale = changed_since(head, clone)
    rel = str(gateway_file.relative_to(clone))
    assert stale["packages"] == ["gateway/", "streams/"] and stale["files"] == sorted([rel, "streams/new_module.py"])
    assert commit_info(clone)["git_dirty"] is True
    capsys.readouterr()
    assert run_all.staleness(run, clone) == 1
    printed = capsys.readouterr().out
    assert "changed since: gateway/, streams/" in printed and rel in printed

    git(clone, "add", "-A")
    git(clone, "commit", "--quiet", "-m", "a change after the benchmark")
    assert changed_since(head, clone)["packages"] == ["gateway/", "streams/"]  # committed since: still stale


def test_an_unknown_commit_is_stale(clone):
    stale = changed_since("0" * 40, clone)
    assert stale["known"] is False and stale["packages"]
    assert run_all.staleness({"machine": {"git_commit": "0" * 12}}, clone) == 1


def test_the_budgets_fit_the_issue():
    full = sum(run_all.budget(n, False) for n in run_all.discover(ROOT / "bench"))
    quick = sum(run_all.budget(n, True) for n in run_all.discover(ROOT / "bench"))
    assert full <= 30 * 60 and quick <= 8 * 60, (full, quick)
    assert set(run_all.discover(ROOT / "bench")) <= set(run_all.BUDGET_S)  # every benchmark claimed its time
