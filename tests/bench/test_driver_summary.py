"""bench/driver.py's figures from its runs: medians per async level and speedups within a round."""

from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("bench_driver", Path(__file__).parents[2] / "bench" / "driver.py")
driver = importlib.util.module_from_spec(spec)
spec.loader.exec_module(driver)


def run(rnd: int, level: int, sph: float, idle: float) -> dict:
    return {"round": rnd, "async_level": level, "steps_per_hour": sph, "engine_idle_fraction": idle}


def test_speedups_are_taken_within_a_round_and_failed_runs_are_left_out():
    runs = [run(0, 0, 100, 0.6), run(0, 1, 150, 0.3), run(0, 2, 160, 0.2),
            run(1, 0, 200, 0.5), run(1, 1, 220, 0.4), {"round": 1, "async_level": 2, "failed": ["boom"]}]
    out = driver.summarize(runs)
    # round 0: 1.5x; round 1: 1.1x (a faster machine for every level in round 1 moves no ratio)
    assert out["async_speedup_s1"] == 1.3 and out["async_speedup_s1_min"] == 1.1
    assert out["async_speedup_s2"] == 1.6  # round 1's S = 2 failed: only round 0 counts
    assert out["steps_per_hour_s0"] == 150 and out["steps_per_hour_s0_min"] == 100
    assert out["engine_idle_fraction_s1"] == 0.35 and out["engine_idle_s1_vs_s0"] == round(0.35 / 0.55, 3)


def test_nothing_measured_gives_none_not_a_crash():
    out = driver.summarize([{"round": 0, "async_level": 0, "failed": ["x"]}])
    assert out["steps_per_hour_s0"] is None and out["async_speedup_s1"] is None and out["engine_idle_s1_vs_s0"] is None
