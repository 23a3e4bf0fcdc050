"""Bounded asynchrony, measured: whole ``polarstream run`` experiments of the arith family at async levels
S = 0, 1 and 2, in interleaved rounds (S0 S1 S2, S0 S1 S2, ...), each a real run of every component.

Per run, from its demo-summary.json: steps per hour over the training loop (first step out to last step
trained) and the engine's idle fraction there (1 - the engine's busy seconds, GET /stats, over the loop's
wall time). Per level: min and median over rounds. ``async_speedup_s1`` (and ``_s2``) is the median over
rounds of S's steps/hour over S = 0's in the same round. The runs skip evaluation (it is a barrier that
drains the pipeline, the same at every level) and start from the cached warm start of seed 0.

What overlap can buy here is bounded by the cores: each run also records how many of the machine's cores
everything on it kept busy over the loop (/proc/stat). A step costs about the same CPU at every level, so
if S = 0 already keeps B of the C cores busy, no level can run more than C / B times as many steps an hour
(``async_speedup_bound``): the arithmetic the goal is judged against.

    .venv/bin/python bench/driver.py [--quick] [--rounds N] [--steps N]
"""

from __future__ import annotations

MEASURES = ('polarstream/driver/', 'polarstream/demo/preset.py', 'trainer/', 'streams/', 'engine/',
            'gateway/')  # the code these figures describe (bench/_provenance.py)

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
LEVELS = (0, 1, 2)


def run_once(exp: Path, level: int, run_dir: Path, timeout_s: float) -> dict:
    """One ``polarstream run`` at async level ``level``; the figures of its demo-summary.json."""
    cmd = [sys.executable, "-c", "from polarstream.cli import main; main()", "run", str(exp), "--async-level", str(level),
           "--seed", "0", "--run-dir", str(run_dir)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if p.returncode != 0:
        return {"async_level": level, "failed": (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]}
    s = json.loads((run_dir / "demo-summary.json").read_text())
    return {"async_level": level, "steps_per_hour": s["steps_per_hour"], "engine_idle_fraction": s["engine_idle_fraction"],
            "rl_loop_s": s["rl_loop_s"], "machine_busy_cores": s.get("machine_busy_cores"), "first_quarter": round(s["first_quarter_mean"], 3),
            "last_quarter": round(s["last_quarter_mean"], 3), "wall_s": round(time.monotonic() - t0, 1)}


def summarize(runs: list[dict]) -> dict:
    """Per level min/median steps/hour and idle fraction; per-round speedups over S = 0."""
    out: dict = {}
    for level in LEVELS:
        ok = [r for r in runs if r["async_level"] == level and "failed" not in r]
        for key, name in (("steps_per_hour", "steps_per_hour"), ("engine_idle_fraction", "engine_idle_fraction"),
                          ("machine_busy_cores", "machine_busy_cores")):
            values = [r[key] for r in ok if r.get(key) is not None]
            out[f"{name}_s{level}"] = round(statistics.median(values), 3) if values else None
            out[f"{name}_s{level}_min"] = round(min(values), 3) if values else None
    for level in LEVELS[1:]:
        ratios = []
        for rnd in {r["round"] for r in runs}:
            by = {r["async_level"]: r for r in runs if r["round"] == rnd and "failed" not in r}
            if level in by and 0 in by and by[0].get("steps_per_hour"):
                ratios.append(by[level]["steps_per_hour"] / by[0]["steps_per_hour"])
        out[f"async_speedup_s{level}"] = round(statistics.median(ratios), 3) if ratios else None
        out[f"async_speedup_s{level}_min"] = round(min(ratios), 3) if ratios else None
    idle0, idle1 = out.get("engine_idle_fraction_s0"), out.get("engine_idle_fraction_s1")
    out["engine_idle_s1_vs_s0"] = round(idle1 / idle0, 3) if idle0 and idle1 is not None else None
    busy0 = out.get("machine_busy_cores_s0")  # at most cores / busy0 as many steps an hour at any level
    out["async_speedup_bound"] = round((os.cpu_count() or 1) / busy0, 3) if busy0 else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 round of 4-step runs")
    ap.add_argument("--rounds", type=int, default=0, help="interleaved rounds (default: 2, quick 1)")
    ap.add_argument("--steps", type=int, default=0, help="trainer steps per run (default: 12, quick 4)")
    args = ap.parse_args()
    rounds, steps = args.rounds or (1 if args.quick else 2), args.steps or (4 if args.quick else 12)
    tmp = Path(tempfile.mkdtemp(prefix="bench-driver-"))
    exp = tmp / "arith.yaml"
    exp.write_text(yaml.safe_dump({**yaml.safe_load((ROOT / "examples" / "arith.yaml").read_text()), "eval": "", "max_steps": steps}))
    result: dict = {"mode": "quick" if args.quick else "full", "cores": os.cpu_count(), "rounds": rounds,
                    "steps_per_run": steps, "groups_per_step": 4, "group_size": 8, "load_avg_start": os.getloadavg()[0]}
    runs = []
    for rnd in range(rounds):
        for level in LEVELS:
            r = run_once(exp, level, tmp / f"r{rnd}-s{level}", timeout_s=900)
            runs.append({"round": rnd, **r})
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)  # progress: one line per run
    result.update(summarize(runs))
    result.update({"runs": runs, "load_avg_end": os.getloadavg()[0],
                   "goal": "async_speedup_s1 >= 1.2 and engine_idle_fraction_s1 <= 0.5 x engine_idle_fraction_s0"})
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
