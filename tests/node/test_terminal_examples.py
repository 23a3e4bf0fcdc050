"""Published-style Harbor tasks (examples/terminal: environment/Dockerfile, no workspace/) checked by
``polarstream tasks DIR --check`` in containers of their own images: every solution scores 1 and every
untouched container 0; a Dockerfile that does not build and a task that asks for a GPU are one line each,
beside a workspace task that still runs under bwrap (runtime auto)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from polarstream.cli import app

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
TERMINAL = ROOT / "examples" / "terminal"


def _rows(output: str) -> dict[str, str]:
    return {line.split()[0]: line for line in output.splitlines()[1:] if line.strip()}


def test_every_terminal_example_scores_1_solved_and_0_untouched_in_its_own_container(podman_base):
    r = CliRunner().invoke(app, ["tasks", str(TERMINAL), "--check"])
    assert r.exit_code == 0, r.output
    header, *lines = r.output.splitlines()
    assert header.split() == ["task", "solution", "untouched", "build", "s", "run", "s", "image", "verifier", "net", "verdict"]
    rows = _rows(r.stdout)
    assert len(rows) == 7, r.output
    # Terminal-Bench 2.0's own shape: a docker_image no registry here serves (built from its Dockerfile instead),
    # FROM python:3.13-slim-bookworm and ubuntu:24.04 (stand-ins), and the uv prelude, whose verifier gets
    # the network (no allow_internet key: Harbor's default) and reaches PyPI and Debian through the site's CA
    tb2 = {"ini-to-env", "merge-busy-intervals"}
    assert tb2 <= rows.keys(), r.output
    for task, line in rows.items():
        solution, untouched, build_s, run_s, image, net, verdict = line.split()[1:]
        assert (solution, untouched, verdict) == ("1", "0", "ok"), line
        # ours say allow_internet = false: Harbor would give their verifiers none either
        assert net == ("outside" if task in tb2 else "none"), line
        assert float(build_s) >= 0 and float(run_s) > 0 and image.startswith("built"), line


def _harbor(root: Path, name: str, dockerfile: str, toml: str = "") -> None:
    d = root / name
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "instruction.md").write_text("Do it.\n")
    (d / "tests" / "test.sh").write_text("test -f /app/done\n")
    (d / "environment" / "Dockerfile").write_text(dockerfile)
    (d / "task.toml").write_text(toml)


def test_a_task_that_does_not_build_and_one_that_needs_a_gpu_are_one_line_each(tmp_path, podman_base):
    _harbor(tmp_path, "broken-build", f"FROM {podman_base}\nWORKDIR /app\nRUN true\nRUN echo nope >&2 && exit 3\n")
    _harbor(tmp_path, "wants-gpu", f"FROM {podman_base}\n", "[environment]\ngpus = 1\n")
    shutil.copytree(ROOT / "examples" / "coding" / "fix-word-count", tmp_path / "fix-word-count")  # a workspace task
    r = CliRunner().invoke(app, ["tasks", str(tmp_path), "--check"])
    assert r.exit_code == 1, r.output
    rows = _rows(r.stdout)
    assert set(rows) == {"broken-build", "wants-gpu", "polarstream-fix-word-count"}, r.stdout
    assert len(r.stdout.splitlines()) == 4, r.stdout  # the header and one line a task
    assert re.search(r"FAILED: image build failed at STEP 4/\d: RUN echo nope >&2 && exit 3: .*exit status 3", rows["broken-build"])
    assert "refused: needs 1 GPU(s)" in rows["wants-gpu"]
    assert rows["polarstream-fix-word-count"].split()[1:3] == ["1", "0"] and rows["polarstream-fix-word-count"].endswith("ok")
    assert r.stderr.strip() == "error: 2 of 3 tasks failed their check (untouched must score 0, the solution 1)"
