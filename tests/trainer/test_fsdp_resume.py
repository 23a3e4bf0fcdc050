"""Sharded train state on the S3 server (DCP through fsspec) resumes at another world size: saved by 2
FSDP2 ranks and resumed by one process, and the reverse, each resumed run's next two step losses equal
the uninterrupted run's to 1e-6 (the weights and the AdamW moments both came back; issue 50)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.models import ensure_model
from tests.plugins.trainer import settings_env

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SCRIPT = Path(__file__).with_name("fsdp_resume.py")

pytestmark = pytest.mark.integration


def _run(world: int, url: str, mode: str, out: Path, env: dict) -> dict:
    launcher = [TORCHRUN, "--standalone", "--nproc-per-node", str(world)] if world > 1 else [sys.executable]
    run = subprocess.run([*launcher, str(SCRIPT), str(ensure_model("tiny")), url, mode, str(out)], env=env,
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["world"] == world and got["strategy"] == ("fsdp" if world > 1 else "single")
    return got


@pytest.mark.parametrize("saved_by, resumed_by", [(2, 1), (1, 2)])
def test_train_state_resumes_at_another_world_size(polar_settings, tmp_path, saved_by, resumed_by):
    env = {**os.environ, **settings_env(polar_settings), "OMP_NUM_THREADS": "1"}
    url = f"{polar_settings.storage_url}/reshard-{saved_by}-{resumed_by}"
    assert url.startswith("s3://")
    whole = _run(saved_by, url, "save", tmp_path / "whole.json", env)["losses"]
    resumed = _run(resumed_by, url, "resume", tmp_path / "resumed.json", env)["losses"]
    assert len(whole) == 3 and len(resumed) == 2
    assert whole[1] != whole[2]  # the steps moved the weights
    for a, b in zip(whole[1:], resumed):
        assert abs(a - b) <= 1e-6, (whole, resumed)
