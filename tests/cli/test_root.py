"""The root ``polarstream`` command: what --help opens with, and which failures keep their traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import typer
from typer.testing import CliRunner

from polarstream.cli import ORDER, app

POLARSTREAM = [sys.executable, "-c", "from polarstream.cli import main; main()"]


def test_help_says_what_it_is_then_lists_commands_as_a_user_meets_them():
    r = CliRunner().invoke(app, ["--help"], prog_name="polarstream")
    assert r.exit_code == 0
    text = [line.strip() for line in r.output.splitlines() if line.strip()]
    assert text[0].startswith("Usage: polarstream") and text[1].startswith("polarstream: reinforcement learning")
    listed = [m.group(1) for m in re.finditer(r"^│ ([a-z][a-z-]*) ", r.output, re.M)]
    meets = ["demo", "infra", "engine", "gateway", "node", "rollout", "submit", "status", "streams", "train", "replay",
             "eval", "export"]
    assert [c for c in listed if c in meets] == meets
    assert listed == [c for c in ORDER if c in listed] + [c for c in listed if c not in ORDER]
    assert set(listed) == set(typer.main.get_command(app).commands)


def test_expected_failures_keep_their_traceback_with_debug(tmp_path):
    missing = str(tmp_path / "missing.jsonl")
    r = CliRunner().invoke(app, ["submit", missing])
    assert r.exit_code == 1 and r.stderr == f"error: no such file or directory: {missing}\n"
    r = CliRunner().invoke(app, ["--debug", "submit", missing])
    assert isinstance(r.exception, FileNotFoundError)
    r = CliRunner().invoke(app, ["submit", missing], env={"POLAR_DEBUG": "1"})
    assert isinstance(r.exception, FileNotFoundError)


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    def broken(*args):
        raise RuntimeError("a bug")

    monkeypatch.setattr("producers.tasks._line_task", broken)
    (tmp_path / "t.jsonl").write_text('{"task_id": "t"}\n')
    r = CliRunner().invoke(app, ["submit", str(tmp_path / "t.jsonl")])
    assert isinstance(r.exception, RuntimeError) and "error:" not in r.stderr


def test_a_real_process_prints_one_line_or_the_traceback(tmp_path):
    missing = tmp_path / "missing.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "POLAR_DEBUG"}
    r = subprocess.run([*POLARSTREAM, "submit", str(missing)], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).parents[2], env=env)
    assert (r.returncode, r.stderr) == (1, f"error: no such file or directory: {missing}\n")
    r = subprocess.run([*POLARSTREAM, "submit", str(missing)], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).parents[2], env={**env, "POLAR_DEBUG": "1"})
    assert r.returncode == 1 and "Traceback" in r.stderr and "FileNotFoundError" in r.stderr
