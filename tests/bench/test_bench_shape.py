"""bench/run_all.py end to end: real subprocesses, real outcomes (ok, crash, timeout, no JSON, missing).

The smoke test runs the cheapest real benchmark (bench/publisher.py --quick, its own Kafka broker)
through run_all and checks the results file's shape and that the page shows the file's numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench import run_all
from bench.render import flatten, is_number
from tests.bench.mdtables import close, section, shown_values, tables

ROOT = Path(__file__).resolve().parents[2]

SCRIPTS = {
    "good": """
        import argparse, json, sys
        ap = argparse.ArgumentParser(); ap.add_argument("--quick", action="store_true")
        quick = ap.parse_args().quick
        print("starting up...")  # a stray log line on stdout must not hide the JSON
        print(json.dumps({"bench": "good", "quick": quick, "rate": 123.456,
                          "comparisons": [{"area": "A", "metric": "rate", "ours": 123.456, "anchor": 100, "anchor_name": "old"}]}, indent=2))
    """,
    "crash": """
        import sys  # --quick
        print("partial output")
        sys.stderr.write("Traceback (most recent call last):\\nRuntimeError: broker would not start\\n")
        sys.exit(3)
    """,
    "slow": """
        import pathlib, subprocess, sys, time  # --quick
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        pathlib.Path(sys.argv[0]).with_suffix(".pid").write_text(str(child.pid))
        time.sleep(120)
    """,
    "nojson": "print('done, but forgot the JSON')  # --quick",
    "helper": "print('{}')  # called by another script: takes no quick flag",
    "_private": "print('{}')  # --quick",
}


@pytest.fixture
def bench_dir(tmp_path):
    d = tmp_path / "bench"
    d.mkdir()
    for name, code in SCRIPTS.items():
        (d / f"{name}.py").write_text(textwrap.dedent(code))
    return d


def test_discover_skips_helpers_private_and_itself(bench_dir):
    assert set(run_all.discover(bench_dir)) == {"good", "crash", "slow", "nojson"}
    assert {"run_all", "render", "trl_peer"}.isdisjoint(run_all.discover(ROOT / "bench"))
    assert "publisher" in run_all.discover(ROOT / "bench")


def test_last_json_object_after_logs():
    assert run_all.last_json_object('log\n{"a": 1}\nmore log\n{\n "b": [1, 2]\n}\n') == {"b": [1, 2]}
    assert run_all.last_json_object("no json here") is None
    assert run_all.last_json_object("[1, 2]") is None


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in state  # a zombie has exited and only waits to be reaped


def test_every_outcome_is_recorded_and_the_run_goes_on(bench_dir, tmp_path):
    out, doc = tmp_path / "latest.json", tmp_path / "benchmarks.md"
    start = time.monotonic()
    rc = run_all.main(["--quick", "--bench-dir", str(bench_dir), "--timeout", "3", "--out", str(out), "--doc", str(doc)])
    assert rc == 0 and time.monotonic() - start < 60
    run = json.loads(out.read_text())
    b = run["benchmarks"]
    assert list(b) == ["crash", "good", "nojson", "slow"]
    assert {n: e["status"] for n, e in b.items()} == {"crash": "failed", "good": "ok", "nojson": "no_json", "slow": "timeout"}
    assert b["good"]["result"]["quick"] is True and b["good"]["comparisons"][0]["ratio"] == 1.2346
    assert "stderr_tail" not in b["good"]
    assert b["crash"]["returncode"] == 3 and "RuntimeError: broker would not start" in b["crash"]["stderr_tail"]
    assert b["slow"]["error"] == "no result within 3 s" and 3 <= b["slow"]["seconds"] < 30
    assert not is_alive(int((bench_dir / "slow.pid").read_text()))  # the whole process group was stopped
    md = doc.read_text()
    assert "RuntimeError: broker would not start" in section(md, "#### crash: failed")
    assert run_all.main(["--quick", "--bench-dir", str(bench_dir), "--only", "crash", "--strict", "--out", str(out), "--doc", str(doc)]) == 1


def test_missing_benchmark_is_recorded(bench_dir, tmp_path):
    out = tmp_path / "latest.json"
    run_all.main(["--bench-dir", str(bench_dir), "--only", "good", "absent", "--out", str(out), "--doc", str(tmp_path / "b.md")])
    b = json.loads(out.read_text())["benchmarks"]
    assert b["good"]["status"] == "ok" and b["good"]["result"]["quick"] is False
    assert b["absent"] == {"status": "missing", "script": "bench/absent.py", "seconds": 0.0,
                           "error": "bench/absent.py does not exist yet"}


@pytest.mark.integration
def test_quick_publisher_run_gives_a_page_that_matches_its_json(tmp_path):
    out, doc = tmp_path / "latest.json", tmp_path / "benchmarks.md"
    proc = subprocess.run([sys.executable, "bench/run_all.py", "--quick", "--only", "publisher", "--timeout", "240",
                           "--out", str(out), "--doc", str(doc)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = json.loads(out.read_text())
    assert run["format"] == 3 and run["mode"] == "quick"
    m = run["machine"]
    assert m["cores"] == os.cpu_count() and m["memory_gb"] > 0 and m["cpu_model"] and m["date"]
    assert m["versions"]["torch"] and m["versions"]["confluent-kafka"] and m["versions"]["kafka_broker"]
    entry = run["benchmarks"]["publisher"]
    assert entry["status"] == "ok", entry.get("stderr_tail")
    result = entry["result"]
    assert result["bench"] == "publisher" and result["quick"] is True
    assert [r["size_bytes"] for r in result["results"]] == [4096, 65536]
    assert all(r["pipelined"]["events_per_s"] > 0 and r["sequential"]["latency_p50_ms"] > 0 for r in result["results"])

    md = doc.read_text()
    runs = {r[0]: r for _, _, rows in tables(section(md, "### Benchmarks run")) for r in rows}
    assert runs["publisher"][1] == "ok" and close(runs["publisher"][2], entry["seconds"])
    shown = shown_values(section(md, "#### publisher: ok"))
    leaves = list(flatten(result))
    assert len(shown) == len(leaves) > 20
    for path, value in leaves:
        key = ".".join(path)
        if is_number(value):
            assert close(shown[key], value), (key, shown[key], value)
