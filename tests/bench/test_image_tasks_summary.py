"""bench/image_tasks.py's figures from its runs: per-target medians and the image/bwrap ratio within a round."""

from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("bench_image_tasks", Path(__file__).parents[2] / "bench" / "image_tasks.py")
image_tasks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(image_tasks)


def run(rnd: int, target: str, s_per_step: float, run_s: float = 1.0) -> dict:
    return {"round": rnd, "target": target, "s_per_step": s_per_step, "steps_per_hour": round(3600 / s_per_step, 1),
            "sessions": {"run_s": {"median": run_s, "max": run_s}}}


def test_ratios_are_taken_within_a_round_and_failed_runs_are_left_out():
    runs = [run(0, "bwrap", 10, 1.0), run(0, "image", 15, 2.0), run(1, "bwrap", 20, 3.0), run(1, "image", 22, 4.0),
            run(2, "bwrap", 10), {"round": 2, "target": "image", "failed": ["boom"]}]
    out = image_tasks.summarize(runs)
    # round 0: 1.5; round 1: 1.1 (a slower machine for both in round 1 moves no ratio); round 2's image failed
    assert out["image_vs_bwrap_step_time_per_round"] == [1.5, 1.1] and out["image_vs_bwrap_step_time"] == 1.3
    assert out["image_vs_bwrap_step_time_min"] == 1.1 and out["image_vs_bwrap_step_time_max"] == 1.5
    assert out["bwrap"]["s_per_step_median"] == 10 and out["bwrap"]["s_per_step_min"] == 10 and out["bwrap"]["runs"] == 3
    assert out["image"]["s_per_step_median"] == 18.5 and out["image"]["failed"] == 1
    assert out["image"]["session_stage_s_median"] == {"run_s": 3.0}


def test_nothing_measured_gives_none_not_a_crash():
    out = image_tasks.summarize([{"round": 0, "target": "bwrap", "failed": ["x"]}])
    assert out["image_vs_bwrap_step_time"] is None and out["bwrap"]["s_per_step_median"] is None
    assert out["image"]["runs"] == 0 and out["image"]["session_stage_s_median"] == {}
