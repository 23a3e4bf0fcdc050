"""bench/_rounds.py: A B A B order, min/median/spread, the CPU floor flags and re-runs starved passes."""

from __future__ import annotations

import os
import time

from bench import _rounds
from bench._rounds import interleaved, proc_cpu_s, summary


def test_targets_alternate_and_are_summarised():
    calls = []

    def target(name: str, sleep: float):
        def run():
            calls.append(name)
            time.sleep(sleep)
            return {"work": 7}
        return run

    res = interleaved({"a": target("a", 0.01), "b": target("b", 0.03)}, 3, progress=False)
    assert calls == ["a", "b"] * 3 and res["order"] == ["a", "b"] and res["rounds"] == 3
    a, b = res["targets"]["a"], res["targets"]["b"]
    assert a["wall_s"]["n"] == 3 and a["wall_s"]["min"] <= a["wall_s"]["median"] <= a["wall_s"]["max"]
    assert b["wall_s"]["median"] > a["wall_s"]["median"] and a["metrics"] == {"work": 7}
    assert [p["round"] for p in a["passes"]] == [0, 1, 2] and set(res["load_avg"]) == {"before", "after"}


def test_a_pass_under_the_cpu_floor_is_flagged_and_rerun():
    res = interleaved({"sleeper": lambda: time.sleep(0.01)}, 2, cpu_floor=0.9, retries=2, progress=False)
    t = res["targets"]["sleeper"]
    assert t["reruns"] == 4 and t["flagged"] == 6  # 2 re-runs per round, and the kept pass still flagged
    assert all(p["low_cpu"] for p in t["passes"])



def test_a_pass_with_cpu_over_the_floor_is_kept(monkeypatch):
    # As if the pass had a whole core (CPU time advancing with wall time): the shared machine's real load
    # must not decide this test.
    monkeypatch.setattr(_rounds, "_cpu_s", time.perf_counter)
    busy = interleaved({"busy": lambda: time.sleep(0.01)}, 2, cpu_floor=0.5, progress=False)["targets"]["busy"]
    assert busy["flagged"] == 0 and busy["reruns"] == 0 and busy["cpu_per_wall"]["min"] > 0.9


def test_summary_and_other_processes_cpu():
    assert summary([2.0, 1.0, 4.0]) == {"min": 1.0, "median": 2.0, "max": 4.0, "spread": 4.0, "n": 3}
    assert proc_cpu_s([os.getpid()]) > 0 and proc_cpu_s([2**22 + 12345]) == 0.0
    assert _rounds.set_threads(1) == 1 and os.environ["OMP_NUM_THREADS"] == "1"
