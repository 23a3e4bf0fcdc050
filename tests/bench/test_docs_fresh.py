"""One source of numbers: every marked figure in README.md and docs/*.md is what bench/results/latest.json renders,
each benchmark's figures say the commit they were measured at, and the staleness list names, per benchmark, the
code it measures that changed since; `make bench` reruns only those benchmarks.

The freshness test re-renders copies of the pages from the committed latest.json and compares: a figure typed
by hand between ``<!-- bench:... -->`` markers, or a page not re-rendered after a new run, fails it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from bench import run_all
from bench._provenance import bench_provenance, changed_for, changed_since, commit_info, declared_inputs
from bench.render import MARKER, OWN_RESULTS, own_results, pages, render, render_docs, render_into, render_markers, with_own

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
    own = own_results(ROOT)  # bench/results/offpolicy.json, run by hand
    marked = with_own(run, own)
    copies = copy_pages(tmp_path)
    render_docs(run, tmp_path, stale={n: changed_for(n, e, marked, ROOT) for n, e in marked["benchmarks"].items()}, own=own)
    stale_pages = [str(c.relative_to(tmp_path)) for c in copies if c.read_text() != (ROOT / c.relative_to(tmp_path)).read_text()]
    assert not stale_pages, (f"{stale_pages} differ from what bench/results/latest.json and {sorted(OWN_RESULTS.values())} "
                             "render (a hand-typed figure inside a marker, or pages not re-rendered): "
                             "run .venv/bin/python bench/run_all.py --render-only")
    assert sum(len(MARKER.findall(c.read_text())) for c in copies) >= 10  # the docs really are marked


def test_a_hand_typed_figure_inside_a_marker_is_replaced():
    run = {"mode": "full", "machine": {"git_commit": "abc123", "date": "2026-01-01"},
           "benchmarks": {"streams": {"status": "ok", "result": {"worker": {"burst": {"calls_per_s": 304.8}}}}}}
    page = "worker: <!-- bench:streams:worker/burst/calls_per_s -->101<!-- /bench --> calls/s"
    assert render_markers(page, run, None) == "worker: <!-- bench:streams:worker/burst/calls_per_s -->304.8<!-- /bench --> calls/s"
    missing = render_markers("<!-- bench:streams:worker/none -->7<!-- /bench -->", run, None)
    assert "7" not in missing and "not in latest.json" in missing


def test_a_benchmark_run_by_hand_renders_from_its_own_results_file(tmp_path):
    """bench/offpolicy.py's results file, not latest.json, feeds its markers, with the commit it records."""
    def row(run, seed, rewards, learned):
        return {"run": run, "seed": seed, "noise": 0, "rewards": rewards, "learned": learned, "git_commit": "abc123"}

    result = {"provenance": {"git_commit": "abc123", "date": "2026-12-06", "mode": "full"},
              "runs": [row("gspo", 0, [0.1] * 4 + [0.5] * 4, True), row("gspo", 1, [0.5, 0.9, 0.5, 0.5, 0, 0, 0, 0], False),
                       row("cispo", 0, [0.2] * 8, False)]}
    (tmp_path / "bench/results").mkdir(parents=True)
    (tmp_path / OWN_RESULTS["offpolicy"]).write_text(json.dumps(result))
    (tmp_path / "README.md").write_text("<!-- bench:offpolicy:summary -->| gspo | 0 | 0.99 |<!-- /bench -->\n")
    render_docs({"benchmarks": {}}, tmp_path, stale={"offpolicy": {"known": True, "packages": ["trainer/"], "files": []}})
    text = (tmp_path / "README.md").read_text()
    assert "0.99" not in text and "| 0.10 → 0.50 | 0.60 → 0.00 **no**, fell 0.90 |" in text
    assert "| cispo | 0 | 0.20 → 0.20 **no** | (not run) |" in text and "_Runs: every run at `abc123`._" in text
    assert "offpolicy: measured at `abc123` (full run, 2026-12-06); changed since: `trainer/`." in text


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
    stale = {"rollout": {"known": True, "packages": ["gateway/"], "files": ["gateway/app.py"]}}
    out = render_markers("<!-- bench:rollout:comparisons --><!-- /bench -->", run, stale)
    assert "rollout: measured at `abc123` **(dirty: uncommitted changes)**" in out and "changed since: `gateway/`" in out
    assert "**Rollout [simulation]**" in out and "ours 2.00× better" in out
    clean = render_markers("<!-- bench:rollout:provenance --><!-- /bench -->", dict(run, machine={"git_commit": "abc"}),
                           {"rollout": {"known": True, "packages": [], "files": []}})
    assert "changed since: nothing" in clean and "dirty" not in clean


def test_each_benchmark_states_its_own_commit():
    """Entries merged from different runs: each figure says the commit its own benchmark ran at."""
    run = {"mode": "full", "machine": {"git_commit": "new000", "date": "2026-12-05"}, "benchmarks": {
        "streams": {"status": "ok", "result": {"worker_calls_per_s": 900},
                    "provenance": {"git_commit": "new000", "date": "2026-12-05", "inputs_hash": "x"}},
        "publisher": {"status": "ok", "result": {"events_per_s_4kb": 21000},
                      "provenance": {"git_commit": "old000", "date": "2026-11-01", "inputs_hash": "y"}}}}
    stale = {"streams": {"known": True, "packages": [], "files": []},
             "publisher": {"known": True, "packages": ["producers/"], "files": ["producers/publisher.py"]}}
    page = ("<!-- bench:streams:worker_calls_per_s --><!-- /bench --> <!-- bench:streams:provenance --><!-- /bench -->\n\n"
            "<!-- bench:publisher:events_per_s_4kb --><!-- /bench --> <!-- bench:publisher:provenance --><!-- /bench -->")
    out = render_markers(page, run, stale)
    assert "900<!-- /bench --> <!-- bench:streams:provenance -->_streams: measured at `new000` (full run, 2026-12-05); " \
           "changed since: nothing._" in out
    assert "publisher: measured at `old000` (full run, 2026-11-01); changed since: `producers/`" in out


SCALAR_BLOCKS = {"provenance", "comparisons", "rounds"}


def test_every_figure_in_prose_has_its_provenance_beside_it():
    """A figure typed into a sentence or a table cell is followed, in its paragraph or the next, by its
    benchmark's provenance (a provenance marker, or a table or comparisons block that ends with one)."""
    missing = []
    for page in pages(ROOT):
        text = page.read_text()
        if "<!-- bench:results:start -->" in text:
            head, rest = text.split("<!-- bench:results:start -->", 1)
            text = head + rest.split("<!-- bench:results:end -->", 1)[1]
        marks: list[tuple[str, str, str]] = []

        def hold(mo, marks=marks):
            marks.append((mo[1], mo[2], mo[3]))
            return f"\x00{len(marks) - 1}\x00"

        paragraphs = [[marks[int(i)] for i in re.findall(r"\x00(\d+)\x00", p)]
                      for p in re.split(r"\n\s*\n", MARKER.sub(hold, text))]
        for i, found in enumerate(paragraphs):
            scalars = {n for n, key, body in found if key not in SCALAR_BLOCKS and "\n" not in body and n != "NAME"}
            near = [m for p in paragraphs[i:i + 2] for m in p]
            blocks = {n for n, key, body in near if key in SCALAR_BLOCKS or "\n" in body}
            missing += [f"{page.relative_to(ROOT)}: {n} figure in paragraph {i}" for n in sorted(scalars - blocks)]
    assert not missing, missing


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
    gateway_entry = {"status": "ok", "provenance": bench_provenance(clone / "bench/gateway.py", clone)}
    run = {"machine": {"git_commit": head[:12], "git_commit_full": head, "git_dirty": False},
           "benchmarks": {"gateway": gateway_entry}}
    assert changed_since(head, clone) == {"commit": head, "known": True, "files": [], "packages": []}
    assert run_all.staleness(run, clone) == 0

    # Output and prose are not measured code: neither makes the numbers stale.
    (clone / "bench/results/note.txt").write_text("a new run\n")
    (clone / "docs/gateway.md").write_text("prose\n")
    assert changed_since(head, clone)["files"] == []
    assert run_all.staleness(run, clone) == 0

    gateway_file = next(p for p in sorted((clone / "gateway").glob("*.py")))
    gateway_file.write_text(gateway_file.read_text() + "\n# edited after the benchmark\n")
    (clone / "streams/new_module.py").write_text("x = 1\n")  # untracked: git diff alone would miss it
    stale = changed_since(head, clone)
    rel = str(gateway_file.relative_to(clone))
    assert stale["packages"] == ["gateway/", "streams/"] and stale["files"] == sorted([rel, "streams/new_module.py"])
    assert commit_info(clone)["git_dirty"] is True
    mine = changed_for("gateway", gateway_entry, run, clone)
    assert mine["stale"] and mine["packages"] == ["gateway/"] and mine["files"] == [rel]  # streams/ is not its input
    capsys.readouterr()
    assert run_all.staleness(run, clone) == 1
    printed = capsys.readouterr().out
    assert "gateway: measured at" in printed and "changed since: gateway/" in printed and rel in printed

    git(clone, "add", "-A")
    git(clone, "commit", "--quiet", "-m", "a change after the benchmark")
    assert changed_since(head, clone)["packages"] == ["gateway/", "streams/"]  # committed since: still stale
    assert changed_for("gateway", gateway_entry, run, clone)["stale"]


def test_make_bench_reruns_only_the_benchmarks_whose_inputs_changed(clone):
    """The input-hash logic: a change in streams/ reruns what measures streams/ and keeps the rest;
    a change to the chaos bench itself keeps the publisher's figures; undoing a change undoes the rerun."""
    names = [n for n in run_all.discover(clone / "bench", opt_in=True)]
    provs = {n: bench_provenance(clone / "bench" / f"{n}.py", clone) for n in names}
    previous = {"mode": "full", "benchmarks": {n: {"status": "ok", "provenance": p} for n, p in provs.items()}}

    def rerun() -> set[str]:
        now = {n: bench_provenance(clone / "bench" / f"{n}.py", clone) for n in names}
        return {n for n in names if run_all.needs_run(n, now[n], previous)}

    assert rerun() == set()
    assert "bench/_rounds.py" in declared_inputs(clone / "bench/streams.py", clone)  # the helpers it imports count
    streams_file = clone / "streams/builders.py"
    original = streams_file.read_text()
    streams_file.write_text(original + "\n# a change in streams/\n")
    # what declares streams/ (or the file itself: bench/judge_agreement.py names the judge's modules only)
    measuring_streams = {n for n in names if {"streams/", "streams/builders.py"} & set(provs[n]["inputs"])}
    assert rerun() == measuring_streams and {"streams", "chaos", "trainer"} <= measuring_streams
    assert not {"publisher", "engine", "gateway", "mirror"} & rerun()
    streams_file.write_text(original)
    assert rerun() == set()  # the same code again: nothing to measure

    chaos = clone / "bench/chaos.py"
    chaos.write_text(chaos.read_text() + "\n# the chaos bench changed\n")
    assert rerun() == {"chaos"}
    previous["benchmarks"]["publisher"]["status"] = "failed"
    assert rerun() == {"chaos", "publisher"}  # a benchmark without good figures always runs


def test_an_unknown_commit_is_stale(clone):
    stale = changed_since("0" * 40, clone)
    assert stale["known"] is False and stale["packages"]
    run = {"machine": {"git_commit": "0" * 12}, "benchmarks": {"engine": {"status": "ok"}}}
    assert run_all.staleness(run, clone) == 1


def test_the_budgets_fit_the_issue():
    full = sum(run_all.budget(n, False) for n in run_all.discover(ROOT / "bench"))
    quick = sum(run_all.budget(n, True) for n in run_all.discover(ROOT / "bench"))
    assert full <= 30 * 60 and quick <= 8 * 60, (full, quick)
    assert set(run_all.discover(ROOT / "bench")) <= set(run_all.BUDGET_S)  # every benchmark claimed its time


def test_a_merged_run_keeps_each_entrys_commit_and_a_failed_rerun_keeps_the_good_figures(tmp_path):
    old = {"mode": "full", "machine": {"git_commit": "old000", "date": "2026-11-01"},
           "benchmarks": {"trainer": {"status": "ok", "result": {"x": 1}}, "streams": {"status": "ok", "result": {"y": 2}}}}
    path = tmp_path / "latest.json"
    path.write_text(json.dumps(old))
    previous = run_all.load_previous(path, "full")
    assert previous["benchmarks"]["trainer"]["provenance"]["git_commit"] == "old000"  # not the next run's commit
    assert run_all.load_previous(path, "quick") == {}  # a quick run never merges into full figures
    failed = {"status": "timeout", "error": "no result within 200 s", "provenance": {"git_commit": "new000"}}
    kept = run_all.keep_good(failed, previous["benchmarks"]["streams"])
    assert kept["status"] == "ok" and kept["result"] == {"y": 2} and kept["last_attempt"]["status"] == "timeout"
    assert run_all.keep_good({"status": "ok", "result": {"y": 3}}, previous["benchmarks"]["streams"])["result"] == {"y": 3}


def test_a_rerun_that_cannot_measure_a_figure_keeps_its_last_measured_value_with_its_commit():
    before = {"status": "ok", "provenance": {"git_commit": "aaa111", "date": "2026-11-01"},
              "result": {"ours": 10.0, "peer": 12.0, "vs_peer": 0.83}}
    rerun = {"status": "ok", "provenance": {"git_commit": "bbb222"},
             "result": {"ours": 11.0, "peer": None, "peer_reason": "could not install", "vs_peer": None}}
    kept = run_all.keep_good(rerun, before)["result"]
    assert kept["ours"] == 11.0 and kept["peer"] == 12.0 and kept["vs_peer"] == 0.83  # new where measured, else kept
    assert kept["kept"] == {"peer": {"value": 12.0, "git_commit": "aaa111", "date": "2026-11-01"},
                            "vs_peer": {"value": 0.83, "git_commit": "aaa111", "date": "2026-11-01"}}
    again = run_all.keep_good({**rerun, "result": dict(rerun["result"])}, {"status": "ok", "result": kept,
                                                                           "provenance": {"git_commit": "bbb222"}})
    assert again["result"]["kept"]["peer"]["git_commit"] == "aaa111"  # a second miss still names where it was measured
    page = render({"format": 3, "mode": "full", "machine": {"git_commit": "bbb222", "date": "2026-12-01"},
                   "benchmarks": {"gateway": {**rerun, "result": kept}}})
    assert re.search(r"`peer` = 12(\.0+)? is kept from the run at `aaa111`", page), page
