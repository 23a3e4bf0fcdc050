"""bench/offpolicy.py's grid (issue 74): its cells, and a rendered table whose rows are distinct runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import offpolicy as O  # noqa: E402


def _run(condition, method, seed, rewards, masked=0.0, clipped=0.0):
    n = len(rewards)
    return {"run": method, "condition": condition, "seed": seed, "rewards": rewards, "learned": O.learned(rewards),
            "settings": O.grid_settings(condition, method),
            "metrics": {k: [masked if k == "corrected_frac" else clipped if k == "clip_frac" else 0.01] * n
                        for k in O.GRID_KEEP}}


def test_every_cell_is_stale_with_minibatches_and_the_control_is_proximal_without_correction():
    for cond in O.CONDITIONS:
        for method in O.METHODS:
            s = O.grid_settings(cond, method)
            assert s["stale"] == 1 and s["trainer"]["minibatches"] == 4
        assert O.grid_settings(cond, O.CONTROL) == {"stale": 1, "trainer": {"minibatches": 4, "ratio_base": "proximal"},
                                                    **O.CONDITIONS[cond]}
    assert O.grid_settings("noise0.5", "tis")["logit_noise"] == 0.5
    assert O.grid_settings("bf16", "icepop")["engine_dtype"] == "bfloat16"


def test_identical_curves_under_different_settings_are_caught():
    a = _run("bf16", "icepop", 0, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8], masked=0.0)
    b = _run("bf16", "token_rs", 0, list(a["rewards"]), masked=0.0)  # the same curve under another name
    c = _run("bf16", "control", 0, [0.1, 0.1, 0.2, 0.3, 0.4, 0.4, 0.5, 0.5])
    assert O.duplicate_curves([a, c]) == []
    assert O.duplicate_curves([a, b, c]) == [("bf16/icepop/s0", "bf16/token_rs/s0")]


def test_the_committed_grid_has_distinct_rows():
    """The results file bench/render.py renders: once it is issue 74's grid (version 2), no two of its rows may
    be one run under two names."""
    result = json.loads((ROOT / "bench/results/offpolicy.json").read_text())
    if result.get("version") != 2:
        pytest.skip("bench/results/offpolicy.json is still issue 65's grid (one update per batch): rerun the grid")
    assert O.duplicate_curves(result["runs"]) == []


def test_the_grid_renders_a_row_per_run_and_the_gain_over_the_control():
    runs = [_run("noise0.5", "control", s, [0.2] * 4 + [0.4] * 4) for s in (0, 1)]
    runs += [_run("noise0.5", "icepop", s, [0.2] * 4 + [0.5 + s / 10] * 4, masked=0.02, clipped=0.1) for s in (0, 1)]
    result = {"version": 2, "runs": runs}
    table = O.markdown(result, "table")
    assert table.count("| noise0.5 | icepop |") == 2 and "| +0.10 |" in table and "| +0.20 |" in table
    summary = O.markdown(result, "summary")
    assert "| noise0.5 | icepop | 2 of 2 | 0.55 | +0.15 (beats it on every seed) | 0.020 | 0.100 |" in summary
    with pytest.raises(ValueError, match="renders no 'plot'"):
        O.markdown(result, "plot")
