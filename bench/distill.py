"""Learning from the log (issue 78), measured on the demo: on-policy distillation without a reward, against
the RL demo it learns from, in interleaved rounds; and SFT on one demo run's successful trajectories.

Round 0 runs the RL demo (seed 0: ``polarstream run`` of polarstream/demo/demo.yaml, every component a real
process); its final checkpoint, exported (``polarstream export --checkpoint``), is the teacher. Then, per
round: a distillation run (the same file with ``distill: {teacher: DIR, reward_weight: 0}``: a fresh warm
start as the student, the task reward off, the teacher served by its own engine) and, from round 1 on, the
RL demo again, so each distillation run has an RL run beside it on the same machine at about the same load.

Per run, from its demo-summary.json: held-out pass@1 before and after (the demo's own evaluation) and the
training loop's wall time. ``distill_wall_vs_rl`` is the median over rounds of distillation's wall time over
the RL run's of the same round (round 0 pairs with the teacher's own run).

SFT: ``polarstream sft`` of round 0's RL run (its topic prefix; reward 1, its training task set only, never
the held-out one) into a fresh warm start, exported, and its held-out pass@1 measured in process
(``polarstream.demo.learning.answer_rates``: the demo's prompts, tool and verdict, 8 samples per held-out
problem); the warm start and the teacher are measured the same way beside it, so the three compare.

    .venv/bin/python bench/distill.py [--quick] [--rounds N] [--steps N] [--out FILE]

Bars (the issue's): distillation's held-out pass@1 after >= 0.8 from the warm start's ~0.2, its wall time
<= 1.5x the RL demo's; the SFT student's held-out pass@1 >= 0.7. Not part of ``make bench`` until it has run
once alone (a round is two demo runs: ~10-25 min of 2 idle cores); ``--quick`` is 1 round of 6-step runs.
"""

from __future__ import annotations

MEASURES = ("trainer/", "engine/", "streams/", "polarstream/driver/", "polarstream/demo/", "gateway/")  # (_provenance)

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
sys.path.insert(0, str(ROOT))
POLAR = [sys.executable, "-c", "from polarstream.cli import main; main()"]
BARS = {"distill_heldout_after": 0.8, "distill_wall_vs_rl": 1.5, "sft_heldout": 0.7}


def polar(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([*POLAR, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def demo_run(exp: dict, run_dir: Path, timeout_s: float) -> dict:
    """One ``polarstream run`` of ``exp``; the figures of its demo-summary.json (or why it failed)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(exp))
    t0 = time.monotonic()
    p = polar("run", str(path), "--run-dir", str(run_dir), timeout_s=timeout_s)
    if p.returncode != 0:
        return {"failed": ((p.stderr or p.stdout).strip().splitlines() or ["no output"])[-1]}
    s = json.loads((run_dir / "demo-summary.json").read_text())
    return {"heldout_before": s["heldout_before"], "heldout_after": s["heldout_after"], "wall_time_s": s["wall_time_s"],
            "first_quarter": round(s["first_quarter_mean"], 3), "last_quarter": round(s["last_quarter_mean"], 3),
            "checkpoint_url": s["checkpoint_url"], "model_dir": s["model_dir"], "topic_prefix": s["topic_prefix"],
            "command_s": round(time.monotonic() - t0, 1)}


def export(checkpoint_url: str, out: Path, timeout_s: float = 600) -> Path:
    p = polar("export", "--checkpoint", checkpoint_url, "--out", str(out), timeout_s=timeout_s)
    if p.returncode != 0:
        raise SystemExit(f"export of {checkpoint_url} failed: {(p.stderr or p.stdout).strip()[-500:]}")
    return out


def sft_student(rl: dict, work: Path, steps_timeout_s: float) -> dict:
    """``polarstream sft`` of the RL run's successful training trajectories into its warm start; the exported model."""
    ck = f"file://{work / 'sft-checkpoints'}"
    t0 = time.monotonic()
    p = polar("sft", "--model", rl["model_dir"], "--topic-prefix", rl["topic_prefix"], "--min-reward", "1",
              "--task-set", "demo-arith", "--rows-per-step", "16", "--lr", "5e-4", "--token-budget", "4096",
              "--checkpoint-url", ck, "--run-dir", str(work / "sft"), "--set", "progress=false",
              "--set", "tensorboard=false", timeout_s=steps_timeout_s)
    if p.returncode != 0:
        return {"failed": ((p.stderr or p.stdout).strip().splitlines() or ["no output"])[-1]}
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    return {"steps": summary["step"], "rows": summary["counters"].get("rows", 0), "seconds": round(time.monotonic() - t0, 1),
            "model": str(export(summary["checkpoint"], work / "sft-model"))}


def heldout_pass(model_dir: str, seed: int = 0, samples: int = 8) -> float:
    """Held-out pass@1 in process: the demo's held-out problems of ``seed``, its prompts, tool and verdict."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gateway.harnesses.builtin import SYSTEM, TOOLS
    from polarstream.demo import arith
    from polarstream.demo.learning import answer_rates

    _, heldout = arith.split(seed, 16)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    return round(answer_rates(model, tok, heldout, samples, system=SYSTEM, tools=TOOLS, seed=seed)["pass_rate"], 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 round of 6-step runs")
    ap.add_argument("--rounds", type=int, default=0, help="interleaved rounds (default 2, quick 1)")
    ap.add_argument("--steps", type=int, default=0, help="steps per run (default: the demo's 24, quick 6)")
    ap.add_argument("--out", default="", help="also write the JSON here")
    args = ap.parse_args()
    rounds, steps = args.rounds or (1 if args.quick else 2), args.steps or (6 if args.quick else 24)
    work = Path(tempfile.mkdtemp(prefix="bench-distill-"))
    demo = {**yaml.safe_load((ROOT / "polarstream" / "demo" / "demo.yaml").read_text()), "max_steps": steps, "seed": 0}
    result: dict = {"mode": "quick" if args.quick else "full", "cores": os.cpu_count(), "rounds": rounds, "steps": steps,
                    "load_avg_start": os.getloadavg()[0], "bars": BARS}
    runs: list[dict] = []
    rl0 = demo_run({**demo, "name": "rl-r0"}, work / "rl-r0", timeout_s=3600)
    runs.append({"round": 0, "kind": "rl", **rl0})
    print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    if "failed" in rl0:
        print(json.dumps({**result, "runs": runs, "error": "the teacher's RL run failed"}, indent=1))
        return
    teacher = export(rl0["checkpoint_url"], work / "teacher")
    distill = {"teacher": str(teacher), "weight": 1.0, "reward_weight": 0.0}
    for rnd in range(rounds):
        if rnd:
            runs.append({"round": rnd, "kind": "rl", **demo_run({**demo, "name": f"rl-r{rnd}"}, work / f"rl-r{rnd}", 3600)})
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
        d = demo_run({**demo, "name": f"distill-r{rnd}", "distill": distill}, work / f"distill-r{rnd}", 3600)
        runs.append({"round": rnd, "kind": "distill", **d})
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    ok = [r for r in runs if "failed" not in r]
    ratios = []
    for rnd in range(rounds):
        by = {r["kind"]: r for r in ok if r["round"] == rnd}
        if "rl" in by and "distill" in by:
            ratios.append(by["distill"]["wall_time_s"] / by["rl"]["wall_time_s"])
    distilled = [r["heldout_after"] for r in ok if r["kind"] == "distill"]
    result.update({"distill_wall_vs_rl": round(statistics.median(ratios), 3) if ratios else None,
                   "distill_heldout_before": statistics.median([r["heldout_before"] for r in ok if r["kind"] == "distill"])
                   if distilled else None,
                   "distill_heldout_after": round(min(distilled), 4) if distilled else None,
                   "rl_heldout_after": round(statistics.median([r["heldout_after"] for r in ok if r["kind"] == "rl"]), 4)})
    sft = sft_student(rl0, work, steps_timeout_s=3600)
    if "failed" not in sft:
        sft.update(heldout=heldout_pass(sft["model"]), warm_start_heldout=heldout_pass(rl0["model_dir"]),
                   teacher_heldout=heldout_pass(str(teacher)))
    result.update({"sft": sft, "sft_heldout": sft.get("heldout"), "runs": runs, "load_avg_end": os.getloadavg()[0]})
    result["met"] = {k: (result.get(k) is not None and (result[k] <= v if k == "distill_wall_vs_rl" else result[k] >= v))
                     for k, v in BARS.items()}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
