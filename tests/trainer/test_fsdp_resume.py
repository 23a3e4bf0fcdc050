"""Checkpoints on the S3 server (HF export + DCP train state through fsspec, manifest last) resume at
another world size, and a rank killed mid-save leaves nothing that loads (issue 50).

One chain of four runs over one checkpoint root, each resuming from the newest complete checkpoint as
the trainer does (the model built without reading its weights files: the train state fills it):

1. 2 FSDP2 ranks: step 0, checkpoint step-1, steps 1-3: the uninterrupted run.
2. 1 process resumes step-1 (saved by 2 ranks): steps 1 and 2, checkpoint step-2 between them.
3. 2 ranks resume step-2 (saved by 1): steps 2 and 3, then checkpoint step-4, where rank 1 is SIGKILLed
   just after its train-state shard reached storage.
4. 1 process resumes: from step-2, not the half-written step-4; step 2 again.

Every resumed step's loss equals the uninterrupted run's to 1e-6. The second step after a resume
depends on the AdamW moments, so those came back too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.models import ensure_model
from tests.plugins.trainer import settings_env

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SCRIPT = Path(__file__).with_name("fsdp_resume.py")

pytestmark = pytest.mark.integration


def _run(world: int, root: str, out: Path, env: dict, until: int, save_at: int, kill_rank: str = "",
         killed: bool = False) -> dict:
    launcher = [TORCHRUN, "--standalone", "--nproc-per-node", str(world)] if world > 1 else [sys.executable]
    args = [str(ensure_model("tiny")), root, str(out), str(until), str(save_at), kill_rank]
    run = subprocess.run([*launcher, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parents[2])
    said = run.stdout[-3000:] + run.stderr[-3000:]
    assert (run.returncode != 0) == killed, said
    assert ("Signal 9 (SIGKILL)" in run.stderr) == killed, said  # torchrun names how rank 1 ended
    got = json.loads(out.read_text())
    assert got["world"] == world and got["strategy"] == ("fsdp" if world > 1 else "single")
    return {"start": got["start"], "losses": {int(k): v for k, v in got["losses"].items()}}


def test_checkpoints_resume_at_another_world_size_and_a_rank_killed_mid_save_is_not_loaded(polar_settings,
                                                                                          tmp_path):
    from trainer import checkpoint

    env = {**os.environ, **settings_env(polar_settings), "OMP_NUM_THREADS": "1"}
    root = f"{polar_settings.storage_url}/fsdp-resume"
    assert root.startswith("s3://")

    whole = _run(2, root, tmp_path / "1.json", env, until=4, save_at=1)
    assert whole["start"] == 0 and sorted(whole["losses"]) == [0, 1, 2, 3]
    assert len(set(whole["losses"].values())) == 4  # the steps moved the weights

    def same(resumed: dict, start: int, steps: list[int]) -> None:
        assert resumed["start"] == start and sorted(resumed["losses"]) == steps, resumed
        for s in steps:
            assert abs(resumed["losses"][s] - whole["losses"][s]) <= 1e-6, (s, resumed, whole)

    same(_run(1, root, tmp_path / "2.json", env, until=3, save_at=2), 1, [1, 2])  # saved by 2, resumed by 1
    same(_run(2, root, tmp_path / "3.json", env, until=4, save_at=4, kill_rank="1", killed=True), 2, [2, 3])  # 1 -> 2

    half = checkpoint.step_dir(root, 4)
    fs, path = checkpoint.filesystem(half, polar_settings)
    fs.invalidate_cache()
    written = fs.find(path)
    assert any(f.endswith(".distcp") for f in written), written  # the killed rank's shard reached storage
    assert not any(f.endswith(checkpoint.MANIFEST) for f in written), written
    assert [c.step for c in checkpoint.list_checkpoints(root, polar_settings)] == [1, 2]

    same(_run(1, root, tmp_path / "4.json", env, until=3, save_at=99), 2, [2])  # the previous checkpoint
