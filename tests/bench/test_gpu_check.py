"""bench/gpu_check.py --cpu: the prepared GPU check's code runs end to end at a tiny size (issue 50)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_the_gpu_check_runs_at_a_tiny_size_on_cpu():
    run = subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout)
    assert (got["device"], got["strategy"], got["world_size"]) == ("cpu", "fsdp", 1)
    for path in ("varlen", "padded"):
        train = got["train"][path]
        assert train["tokens_per_s"] > 0 and train["params"] > 0 and train["mfu"] is None  # no peak known on CPU
    # fp32 on CPU: the sharded model's logprobs are the plain model's
    assert got["parity"]["compute_dtype"] == "float32" and got["parity"]["max_abs_diff"] < 1e-4
    assert got["engine"]["batch1_tokens_per_s"] > 0 and got["engine"]["batch32_tokens_per_s"] > 0
