"""Issue 66: `polarstream run` of Harbor task directories with `model: tiny`, as a new user writes it.

The built-in name is resolved once (infra.models.local_model_dir) and every component loads that directory:
the driver once handed the viewer ``<cwd>/tiny`` and the run failed after six processes had started. Two
example tasks, one group of two a step, two steps; the reward is 0 (an untrained tiny model solves no coding
task), and the run's own name is on its console line, its report and its reward plot.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.node.test_sandbox import needs_bwrap

from .test_run_resume import _env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CODING = Path(__file__).parents[2] / "examples" / "coding"


@needs_bwrap  # Harbor tasks see their workspace at /app: only the bwrap runtime can show it there
@pytest.mark.timeout(600)
def test_a_harbor_run_with_a_built_in_model_trains_two_steps_under_its_own_name(infra, tmp_path):
    for name in ("fix-word-count", "write-slugify"):
        shutil.copytree(CODING / name, tmp_path / "tasks" / name)
    exp = {"name": "harbor-tiny", "model": "tiny", "train": "tasks/", "eval": "", "harness": "builtin",
           "harness_config": {"max_tokens": 12, "max_turns": 1}, "runtime": "bwrap", "group_size": 2,
           "groups_per_step": 1, "max_steps": 2, "seed": 1, "step_timeout_s": 180}
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(exp))
    run_dir = tmp_path / "run"
    # from the experiment's folder, where no directory is named tiny
    r = subprocess.run([sys.executable, "-m", "polarstream", "run", "exp.yaml", "--run-dir", str(run_dir)], cwd=tmp_path,
                       env=_env(infra), capture_output=True, text=True, timeout=540)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert "polarstream harbor-tiny ->" in r.stdout, r.stdout[-2000:]
    summary = json.loads((run_dir / "run-summary.json").read_text())
    assert summary["steps"] == 2 and summary["reward_per_step"] == [0.0, 0.0], summary
    model_dir = Path(json.loads((run_dir / "demo-summary.json").read_text())["model_dir"])
    assert model_dir.is_absolute() and model_dir.name.startswith("tiny-s0-") and (model_dir / "config.json").is_file()
    from PIL import Image

    assert Image.open(run_dir / "reward.png").text["Title"] == "polarstream harbor-tiny: reward while training"
    assert (run_dir / "report.md").read_text().startswith("# polarstream harbor-tiny report")
