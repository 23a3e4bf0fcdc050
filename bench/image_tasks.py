"""Image tasks against the bwrap demo (issue 62): seconds per training step, in interleaved rounds.

The demo's arith family run as published tasks, every session in a podman container of the task's image,
against the same family as the demo runs it, workspace tasks under bwrap, in interleaved rounds of the same
run of this benchmark (bwrap, image, bwrap, image, ...).

Both targets are whole ``polarstream run`` experiments of examples/arith.yaml at the same settings (seed 0,
S = 0, the cached warm start of seed 0, the same steps, groups and group size; evaluation skipped, as
bench/driver.py skips it), started the same way; they differ only in their tasks: the demo's workspace
tasks (``builtin:arith``: the node runs them under bwrap) or the same 81 sums written as Harbor task
directories that each bring environment/Dockerfile (polarstream/demo/image_tasks.py: ``image_preset``,
as examples/image_arith.py runs them; ``runtime: auto`` runs them under podman). The tasks' image is built
(or found) once before the first round, untimed (``image_prebuild_s``), so no round pays for a build.

Per run, from its demo-summary.json: seconds per step over the training loop (``rl_loop_s / steps``: first
step out to last step trained, the span steps/hour is taken over) and steps per hour; and from the run's
session events (``polarstream cat session-events``: the node's ``finished`` events, gateway/node/session.py
``job.metrics``), each stage's seconds per session, median and max over the run's sessions that finished ok:
``init_s`` (the workspace made, or the container opened, the image build or lookup included),
``open_s`` (of that, the sandbox: a container taken from those prepared ahead, or started now;
``open_prepared`` 1 for the former), ``image_build_s`` (building or finding the image), ``ready_wait_s``
(prepared, waiting for a run slot), ``run_s`` (the harness), ``eval_s`` (the verifier; in a container,
``verify_network_s`` to set its network and ``verify_exec_s`` for the one exec that takes its files in
and out) and ``total_s`` (admitted to finished). Per target:
min and median over rounds of s/step and steps/hour, and each stage's median over runs of the runs' medians.
``image_vs_bwrap_step_time`` is the median over rounds of the image run's s/step over the bwrap run's in the
same round (above 1: image tasks are slower per step); ``_min`` and ``_max`` beside it. A run that fails is
kept with its error and counts in no figure. These are short runs on a shared machine: the load average is
recorded before and after, and each pass's CPU per wall second (bench/_rounds.py).

    .venv/bin/python bench/image_tasks.py [--quick] [--rounds N] [--steps N] [--groups N] [--group-size N]
"""

from __future__ import annotations

MEASURES = ('polarstream/demo/image_tasks.py', 'polarstream/demo/preset.py', 'polarstream/driver/', 'producers/tasks.py',
            'gateway/', 'trainer/', 'streams/', 'engine/')  # the code these figures describe (bench/_provenance.py)

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._rounds import interleaved, load_avg  # noqa: E402

TARGETS = ("bwrap", "image")
STAGES = ("init_s", "open_s", "open_prepared", "image_build_s", "ready_wait_s", "run_s", "eval_s", "verify_network_s",
          "verify_exec_s", "total_s")

# One run, as `polarstream run EXP --seed 0 --async-level 0 --run-dir RUN` makes it (polarstream/demo_cli.py),
# on the preset's workspace tasks (bwrap) or on image_preset's image tasks (image): nothing else differs.
RUNNER = """
import sys
from pathlib import Path
from polarstream.driver.configure import run_config
from polarstream.driver.experiment import load_experiment
from polarstream.driver.loop import run_experiment
from polarstream.driver.processes import stop_on_sigterm
exp_path, run_dir, target = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
exp = load_experiment(exp_path, seed=0, async_level=0)
if target == "image":
    from polarstream.demo.image_tasks import image_preset
    preset = image_preset()
else:
    from polarstream.presets import preset_for
    preset = preset_for(exp)
stop_on_sigterm()
try:
    run_experiment(exp, run_config(exp, run_dir, preset=preset), preset)
except Exception as e:
    sys.exit(f"{type(e).__name__}: {e}")
"""


def prebuild_image(tmp: Path) -> dict:
    """Build (or find) the image every image task runs in, before any round: (engine, tag, seconds)."""
    from gateway.runtimes import container_engine
    from gateway.runtimes.images import ensure_image
    from polarstream.demo.image_tasks import write_tasks
    from producers.tasks import harbor_task

    engine = container_engine()
    if not engine:
        raise SystemExit("image_tasks: neither podman nor docker is installed here (`make system` installs podman)")
    train, _ = write_tasks(tmp / "prebuild", seed=0, n=1)
    t0 = time.monotonic()
    tag, built_s = asyncio.run(ensure_image(harbor_task(next(train.iterdir())).environment, engine,
                                            log=tmp / "prebuild.log"))
    return {"engine": engine, "image_tag": tag, "image_prebuild_s": round(time.monotonic() - t0, 1),
            "image_built_now": built_s > 0}


def session_stages(topic_prefix: str) -> dict:
    """Per stage, median and max seconds over the run's sessions that finished ok (their node's job.metrics)."""
    p = subprocess.run([sys.executable, "-m", "polarstream", "cat", "session-events", "--prefix", topic_prefix], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]}
    finished = [e for e in (json.loads(line) for line in p.stdout.splitlines() if line.strip()) if e.get("kind") == "finished"]
    ok = [e for e in finished if e.get("status") == "ok"]  # a session cancelled once its group was complete: no stages
    out: dict = {"sessions": len(finished), "ok": len(ok)}
    for stage in STAGES:
        values = [e["metrics"][stage] for e in ok if stage in (e.get("metrics") or {})]
        if values:
            out[stage] = {"median": round(statistics.median(values), 3), "max": round(max(values), 3)}
    return out


def run_once(exp: Path, target: str, run_dir: Path, timeout_s: float) -> dict:
    """One run of ``target``; the figures of its demo-summary.json and its sessions' stage seconds."""
    t0 = time.monotonic()
    # in this process's group: run_all's Ctrl-C (SIGINT to the group) reaches it, and its finally stops what it started
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(exp), str(run_dir), target], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # as Ctrl-C: the run stops every process it started
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        return {"target": target, "failed": [f"no result within {timeout_s:.0f} s"]}
    if proc.returncode != 0 or not (run_dir / "demo-summary.json").exists():
        return {"target": target, "failed": (err or out).strip().splitlines()[-1:] or ["no output"]}
    s = json.loads((run_dir / "demo-summary.json").read_text())
    steps, loop_s = s["steps"], s.get("rl_loop_s")
    return {"target": target, "steps": steps, "rl_loop_s": loop_s,
            "s_per_step": round(loop_s / steps, 3) if loop_s and steps else None,
            "steps_per_hour": s.get("steps_per_hour"), "machine_busy_cores": s.get("machine_busy_cores"),
            "samples": sum(st.get("samples", 0) for st in s.get("per_step", [])),
            "first_quarter": round(s["first_quarter_mean"], 3), "last_quarter": round(s["last_quarter_mean"], 3),
            "run_wall_s": round(time.monotonic() - t0, 1), "sessions": session_stages(s["topic_prefix"])}


def summarize(runs: list[dict]) -> dict:
    """Per target min/median s/step and steps/hour and stage medians; per-round image/bwrap step-time ratios."""
    out: dict = {}
    for target in TARGETS:
        ok = [r for r in runs if r["target"] == target and "failed" not in r and r.get("s_per_step")]
        fig: dict = {"runs": len(ok), "failed": sum(r["target"] == target and "failed" in r for r in runs)}
        for key in ("s_per_step", "steps_per_hour", "machine_busy_cores"):
            values = [r[key] for r in ok if r.get(key) is not None]
            fig[f"{key}_min"] = round(min(values), 3) if values else None
            fig[f"{key}_median"] = round(statistics.median(values), 3) if values else None
        stages = {}
        for stage in STAGES:
            values = [r["sessions"][stage]["median"] for r in ok if stage in r.get("sessions", {})]
            if values:
                stages[stage] = round(statistics.median(values), 3)
        fig["session_stage_s_median"] = stages
        out[target] = fig
    ratios = []
    for rnd in sorted({r["round"] for r in runs}):
        by = {r["target"]: r for r in runs if r["round"] == rnd and "failed" not in r and r.get("s_per_step")}
        if set(TARGETS) <= by.keys():
            ratios.append(round(by["image"]["s_per_step"] / by["bwrap"]["s_per_step"], 3))
    out["image_vs_bwrap_step_time"] = round(statistics.median(ratios), 3) if ratios else None
    out["image_vs_bwrap_step_time_min"] = min(ratios) if ratios else None
    out["image_vs_bwrap_step_time_max"] = max(ratios) if ratios else None
    out["image_vs_bwrap_step_time_per_round"] = ratios
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 round of 3-step runs of 2 groups of 4")
    ap.add_argument("--rounds", type=int, default=0, help="interleaved rounds (default: 2, quick 1)")
    ap.add_argument("--steps", type=int, default=0, help="trainer steps per run (default: 6, quick 3)")
    ap.add_argument("--groups", type=int, default=0, help="groups per step (default: the demo's 4, quick 2)")
    ap.add_argument("--group-size", type=int, default=0, help="samples per group (default: the demo's 8, quick 4)")
    args = ap.parse_args()
    rounds, steps = args.rounds or (1 if args.quick else 2), args.steps or (3 if args.quick else 6)
    groups, group_size = args.groups or (2 if args.quick else 4), args.group_size or (4 if args.quick else 8)
    tmp = Path(tempfile.mkdtemp(prefix="bench-image-tasks-"))
    exp = tmp / "arith.yaml"
    exp.write_text(yaml.safe_dump({**yaml.safe_load((ROOT / "examples" / "arith.yaml").read_text()), "eval": "",
                                   "max_steps": steps, "groups_per_step": groups, "group_size": group_size}))
    result: dict = {"mode": "quick" if args.quick else "full", "cores": os.cpu_count(), "rounds": rounds,
                    "steps_per_run": steps, "groups_per_step": groups, "group_size": group_size,
                    "load_avg_start": load_avg()}
    result.update(prebuild_image(tmp))
    runs: list[dict] = []
    timeout_s = 600 if args.quick else 1200

    def target(name: str):
        def one() -> dict:
            rnd = sum(r["target"] == name for r in runs)
            r = {"round": rnd, **run_once(exp, name, tmp / f"r{rnd}-{name}", timeout_s)}
            runs.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)  # progress: one line per run
            return {}
        return one

    res = interleaved({name: target(name) for name in TARGETS}, rounds=rounds, progress=False)
    for name in TARGETS:  # each pass's wall and CPU time as bench/_rounds.py measured it, beside the run
        for p, r in zip(res["targets"][name]["passes"], [r for r in runs if r["target"] == name]):
            r.update(pass_wall_s=round(p["wall_s"], 1), cpu_per_wall=round(p["cpu_per_wall"], 3))
    result.update(summarize(runs))
    bwrap, image = result["bwrap"]["s_per_step_median"], result["image"]["s_per_step_median"]
    if bwrap and image:
        result["comparisons"] = [{
            "area": "Image tasks (issue 62)", "metric": f"seconds per step, {groups} groups x {group_size}, S = 0",
            "ours": image, "anchor": bwrap, "anchor_name": "the bwrap demo (workspace tasks)", "unit": "s",
            "higher_is_better": False, "note": f"median of {rounds} interleaved round(s); every session in a "
                                               f"{result['engine']} container of the task's image"}]
    result.update({"order": res["order"], "runs": runs, "load_avg_end": load_avg()})
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
