"""Off-policy losses and corrections on the in-process demo loop where off-policyness is real (issue 74):
rollouts one version stale (S = 1), 4 minibatches (optimizer steps) per batch, and an engine/trainer mismatch:
the sampler's logit noise 0.5 (``noise0.5``) or a bf16 sampler (``bf16``, the engine's --engine-dtype). Each
correction runs beside the control (``ratio_base: proximal``, no correction) on the same seeds; a correction
earns its keep only where it beats the control.

    .venv/bin/python bench/offpolicy.py --grid [--conditions noise0.5,bf16] [--methods control,tis,...]
                                        [--seeds 0,1,2] [--steps 20] [--jobs 2] [--out DIR]
    (full run, 2 x 11 x 3 = 66 runs of 20 steps: --grid --seeds 0,1,2 --jobs 2 --out bench/results/offpolicy-v2, then
     --merge bench/results/offpolicy-v2 --out bench/results; about an hour of 2 idle cores)

Each run's record keeps its commit, every setting, and per-step metrics (reward, masked and clip
fractions, mismatch); ``markdown`` renders one row per run (``table``) and one per condition x method
(``summary``) for a results file of this version (``"version": 2``); older files (issue 65's grid, below)
render as before.

Issue 65's grid (one update per batch, on-policy), kept runnable:

    .venv/bin/python bench/offpolicy.py [--runs NAME[:SEED],...] [--seeds 0,1] [--steps 20] [--noise SIGMA]
                                        [--jobs 2] [--out DIR]

Every run is ``polarstream.demo.learning.rl_run`` as tests/demo/test_learning.py runs it (its cached warm
start, every problem every step, lr 1.2e-3, 8 samples, one torch thread per run), with one setting
changed. ``--noise`` is the sampler's ``logit_noise`` (the engine's ``--logit-noise``) for the runs
named ``noisy_*``: the sampler samples from, and reports logprobs of, logits + N(0, sigma^2).
A run learns when its last-4 mean reward is at least its first-4 mean + 0.2 (the test's bar); its worst
fall is the largest drop of the step reward below its best so far. Prints one
JSON object (every run's rewards and per-step mismatch metrics); writes it and a plot (reward and
mismatch k3 per step) to ``--out``. Not part of ``make bench`` (a full run is ~20-40 min of 2 cores).
Each run keeps its commit, date and load; ``--merge`` joins runs into one ``offpolicy.json`` with a
``provenance`` (the oldest of their commits), from which bench/render.py renders the README's and
docs/trainer.md's tables (``markdown``): ``bench/run_all.py --render-only`` after a merge.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._provenance import commit_info, declared_inputs, git  # noqa: E402

# What the figures measure (bench/_provenance.py): the loop, the trainer's loss and packing, the advantages,
# and the test module whose warm start and problems every run uses.
MEASURES = ("trainer/step.py", "trainer/loss.py", "trainer/corrections.py", "trainer/packing.py", "trainer/optim.py",
            "trainer/config.py", "trainer/attention.py", "trainer/parallel.py", "trainer/lora.py", "engine/sampling.py",
            "polarstream/demo/learning.py", "polarstream/demo/arith.py", "polarstream/demo/shape.py",
            "streams/advantages.py", "tests/demo/test_learning.py")  # what rl_run imports

# name -> LearningConfig overrides; noisy_* also get logit_noise = --noise
RUNS = {
    "ppo_clip": {},
    "gspo": {"loss": "gspo"},  # what `loss: gspo` gets: the default loss_norm, token_mean
    "gspo_seq_mean": {"loss": "gspo", "loss_norm": "seq_mean"},  # the paper's per-sequence mean
    "ppo_seq_mean": {"loss_norm": "seq_mean"},  # seq_mean without gspo: whose is gspo_seq_mean's collapse
    "cispo": {"loss": "cispo"},
    "icepop": {"correction": "icepop"},
    "seq_mask_geo": {"correction": "seq_mask_geo"},
    "no_std": {"std_normalize": False},
    "noisy_ppo_clip": {},
    "noisy_icepop": {"correction": "icepop"},
    "noisy_seq_mask_geo": {"correction": "seq_mask_geo"},
    "noisy_tis": {"correction": "tis", "trainer": {"tis_cap": 2.0}},
}
# The README's row names (bench/render.py renders ``summary`` there, ``table`` in docs/trainer.md).
LABELS = {
    "ppo_clip": "ppo_clip", "gspo": "gspo (`loss_norm` default: `token_mean`)",
    "gspo_seq_mean": "gspo, `loss_norm: seq_mean` (its paper's)", "ppo_seq_mean": "ppo_clip, `loss_norm: seq_mean`",
    "cispo": "cispo", "icepop": "icepop", "seq_mask_geo": "seq_mask_geo", "no_std": "`std_normalize: false`",
    "noisy_ppo_clip": "ppo_clip, no correction", "noisy_icepop": "icepop", "noisy_seq_mask_geo": "seq_mask_geo",
    "noisy_tis": "tis (cap 2)",
}
# Issue 74's grid: method -> LearningConfig overrides, run under each condition with COMMON.
CONTROL = "control"
METHODS = {
    "control": {"trainer": {"ratio_base": "proximal"}},  # decoupled PPO, no correction: what every other is against
    "behaviour": {"trainer": {"ratio_base": "behaviour"}},  # PPO's ratio against the engine (the default today)
    "tis": {"correction": "tis", "trainer": {"ratio_base": "proximal", "tis_cap": 2.0}},
    "icepop": {"correction": "icepop", "trainer": {"ratio_base": "proximal"}},
    "token_rs": {"correction": "token_rs", "trainer": {"ratio_base": "proximal"}},
    "seq_mask_geo": {"correction": "seq_mask_geo", "trainer": {"ratio_base": "proximal"}},
    "seq_mask_arith": {"correction": "seq_mask_arith", "trainer": {"ratio_base": "proximal"}},
    "gspo": {"loss": "gspo", "trainer": {"ratio_base": "proximal"}},
    "cispo": {"loss": "cispo", "trainer": {"ratio_base": "proximal"}},
    # 4 optimizer steps a batch at the demo's lr is 4x the update: these ask whether the collapse is the lr's
    "control_lr/4": {"lr": 3e-4, "trainer": {"ratio_base": "proximal"}},
    "gspo_lr/4": {"lr": 3e-4, "loss": "gspo", "trainer": {"ratio_base": "proximal"}},
}
CONDITIONS = {"noise0.5": {"logit_noise": 0.5}, "bf16": {"engine_dtype": "bfloat16"}}
COMMON = {"stale": 1, "trainer": {"minibatches": 4}}
GRID_KEEP = ("corrected_frac", "clip_frac", "mismatch_k3", "mismatch_ratio_p99", "mismatch_ratio_max", "entropy",
             "grad_norm")
BAR = 0.2
FALL = 0.3  # the summary names a run's worst fall from this size on
MAIN_SEEDS = (0, 1)  # the summary's columns; other seeds are counted in one more
KEEP = ("mismatch_k3", "mismatch_ratio_max", "mismatch_ratio_p99", "corrected_frac", "clip_frac",
        "would_icepop_frac", "would_seq_mask_geo_frac", "entropy", "grad_norm")


def learned(rewards: list[float]) -> bool:
    return sum(rewards[-4:]) / 4 >= sum(rewards[:4]) / 4 + BAR


def one(name: str, seed: int, steps: int, noise: float) -> dict:
    import torch

    torch.set_num_threads(1)
    from gateway.harnesses.builtin import SYSTEM, TOOLS
    from polarstream.demo.learning import LearningConfig, rl_run
    from tests.demo.test_learning import PROBLEMS, WARM_HALF_TOOL, _warm

    settings = dict(RUNS[name])
    if name.startswith("noisy_"):
        settings["logit_noise"] = noise
    cfg = LearningConfig(**{"steps": steps, "samples": 8, "lr": 1.2e-3, "seed": seed, "all_problems": True, **settings})
    t0 = time.time()
    log, _ = rl_run(_warm(WARM_HALF_TOOL), PROBLEMS, cfg, system=SYSTEM, tools=TOOLS)
    rewards = [round(r, 4) for r in log.rewards]
    return {"run": name, "seed": seed, "settings": settings, "rewards": rewards, "learned": learned(rewards),
            "seconds": round(time.time() - t0, 1), "tokens": [s.tokens for s in log.steps],
            "mismatch": {k: [round(s.mismatch.get(k, 0.0), 6) for s in log.steps] for k in KEEP}}


def grid_settings(condition: str, method: str) -> dict:
    """The LearningConfig overrides of one grid cell: COMMON, the condition's, the method's (trainer dicts merged)."""
    out: dict = {}
    for part in (COMMON, CONDITIONS[condition], METHODS[method]):
        for k, v in part.items():
            out[k] = {**out.get(k, {}), **v} if k == "trainer" else v
    return out


def grid_one(condition: str, method: str, seed: int, steps: int) -> dict:
    """One run of issue 74's grid: its settings, rewards and per-step metrics."""
    import torch

    torch.set_num_threads(1)
    from gateway.harnesses.builtin import SYSTEM, TOOLS
    from polarstream.demo.learning import LearningConfig, rl_run
    from tests.demo.test_learning import PROBLEMS, WARM_HALF_TOOL, _warm

    settings = grid_settings(condition, method)
    cfg = LearningConfig(**{"steps": steps, "samples": 8, "lr": 1.2e-3, "seed": seed, "all_problems": True, **settings})
    t0 = time.time()
    log, _ = rl_run(_warm(WARM_HALF_TOOL), PROBLEMS, cfg, system=SYSTEM, tools=TOOLS)
    rewards = [round(r, 4) for r in log.rewards]
    return {"run": method, "condition": condition, "seed": seed, "steps": steps,
            "settings": {k: v for k, v in vars(cfg).items()}, "rewards": rewards, "learned": learned(rewards),
            "seconds": round(time.time() - t0, 1), "tokens": [s.tokens for s in log.steps],
            "metrics": {k: [round(s.mismatch.get(k, 0.0), 6) for s in log.steps] for k in GRID_KEEP}}


def duplicate_curves(runs: list[dict]) -> list[tuple[str, str]]:
    """Pairs of runs with different settings but identical curves (rewards and every per-step metric): one
    run shown under two names, which a table must never do."""
    seen: dict = {}
    dupes = []
    for r in runs:
        key = json.dumps([r["rewards"], r.get("metrics") or r.get("mismatch")], sort_keys=True)
        name = f"{r.get('condition', r.get('noise', ''))}/{r['run']}/s{r['seed']}"
        if key in seen and seen[key][1] != json.dumps(r.get("settings"), sort_keys=True):
            dupes.append((seen[key][0], name))
        seen.setdefault(key, (name, json.dumps(r.get("settings"), sort_keys=True)))
    return dupes


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def control_of(method: str) -> str:
    """The control a method is compared with: the one at its learning rate (``gspo_lr/4``: ``control_lr/4``)."""
    return CONTROL + (method[method.index("_lr/"):] if "_lr/" in method else "")


def grid_table(runs: list[dict]) -> str:
    """Markdown, one row per run: reward first 4 -> last 4, learned, the last-4 gain over the control on the
    same condition and seed, the mean masked (corrected) and clip fractions, the mismatch."""
    ctrl = {(r["condition"], r["run"], r["seed"]): r for r in runs if r["run"] == control_of(r["run"])}
    rows = ["| condition | method | seed | reward first 4 → last 4 | learned | last 4 vs control | masked (mean) | "
            "clipped (mean) | mismatch k3 (mean) | ratio p99 (mean) |",
            "|---|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in runs:
        rw, m, c = r["rewards"], r["metrics"], ctrl.get((r["condition"], control_of(r["run"]), r["seed"]))
        vs = "-" if c is None or r["run"] == control_of(r["run"]) else f"{_mean(rw[-4:]) - _mean(c['rewards'][-4:]):+.2f}"
        rows.append(f"| {r['condition']} | {r['run']} | {r['seed']} | {_mean(rw[:4]):.2f} → {_mean(rw[-4:]):.2f} | "
                    f"{'yes' if r['learned'] else '**no**'} | {vs} | {_mean(m['corrected_frac']):.3f} | "
                    f"{_mean(m['clip_frac']):.3f} | {_mean(m['mismatch_k3']):.2g} | {_mean(m['mismatch_ratio_p99']):.3f} |")
    return "\n".join(rows)


def grid_summary(runs: list[dict]) -> str:
    """Markdown, one row per condition x method: seeds learned, mean last-4 reward, its mean gain over the
    control on the same seeds (beats: above it on every seed), masked and clip fractions."""
    ctrl = {(r["condition"], r["run"], r["seed"]): r for r in runs if r["run"] == control_of(r["run"])}
    rows = ["| condition | method | learned | last 4 (mean) | vs control (same lr, same seeds) | masked | clipped |",
            "|---|---|---|---:|---|---:|---:|"]
    for cond, method in dict.fromkeys((r["condition"], r["run"]) for r in runs):
        rs = [r for r in runs if (r["condition"], r["run"]) == (cond, method)]
        base = control_of(method)
        gains = [_mean(r["rewards"][-4:]) - _mean(ctrl[(cond, base, r["seed"])]["rewards"][-4:])
                 for r in rs if (cond, base, r["seed"]) in ctrl]
        vs = "-" if method == base or not gains else (
            f"{_mean(gains):+.2f}" + (" (beats it on every seed)" if all(g > 0 for g in gains) else ""))
        rows.append(f"| {cond} | {method} | {sum(r['learned'] for r in rs)} of {len(rs)} | "
                    f"{_mean([_mean(r['rewards'][-4:]) for r in rs]):.2f} | {vs} | "
                    f"{_mean([_mean(r['metrics']['corrected_frac']) for r in rs]):.3f} | "
                    f"{_mean([_mean(r['metrics']['clip_frac']) for r in rs]):.3f} |")
    return "\n".join(rows)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax in (ax0, ax1, ax2):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)
    for r in results:
        style = "-" if r["seed"] == 0 else "--"
        noisy = r["run"].startswith("noisy_")
        noise = f" σ{r['noise']:g}" if noisy and "noise" in r else ""
        line, = (ax1 if noisy else ax0).plot(r["rewards"], style, label=f"{r['run']}{noise} s{r['seed']}")
        if noisy:
            ax2.plot(r["mismatch"]["mismatch_k3"], style, color=line.get_color())
    ax0.set(xlabel="step", ylabel="mean reward", title="reward, engine = trainer", ylim=(0, 1))
    ax1.set(xlabel="step", ylabel="mean reward", title="reward, sampler logit noise σ", ylim=(0, 1))
    ax2.set(xlabel="step", ylabel="k3 KL(rollout || trainer) per token", title="mismatch (noisy runs)")
    ax2.set_yscale("log")
    ax0.legend(fontsize=7)
    ax1.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def drawdown(rewards: list[float]) -> float:
    """The largest fall of the step reward below its best so far (peak to trough)."""
    return max(max(rewards[:i + 1]) - r for i, r in enumerate(rewards))


def table(results: list[dict]) -> str:
    """Markdown: one row per run, reward first-4 / last-4 means, learned, and the mismatch over the run."""
    rows = ["| run | noise σ | seed | reward first 4 → last 4 | learned | worst fall | mismatch k3 (mean) | "
            "ratio p99 (mean) | ratio max (max) | corrected (mean) | trained tokens, last step | entropy, last step |",
            "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    for r in results:
        m, rw = r["mismatch"], r["rewards"]
        rows.append(f"| {r['run']} | {r.get('noise', 0) if r['run'].startswith('noisy_') else 0} | {r['seed']} | "
                    f"{mean(rw[:4]):.2f} → {mean(rw[-4:]):.2f} | {'yes' if r['learned'] else '**no**'} | "
                    f"{drawdown(rw):.2f} | "
                    f"{mean(m['mismatch_k3']):.2g} | {mean(m['mismatch_ratio_p99']):.3f} | "
                    f"{max(m['mismatch_ratio_max']):.3g} | {mean(m['corrected_frac']):.3f} | "
                    f"{r['tokens'][-1] if r.get('tokens') else '-'} | "  # -: a run from before they were kept
                    f"{format(m['entropy'][-1], '.2f') if m.get('entropy') else '-'} |")
    return "\n".join(rows)


def noise_of(r: dict) -> float:
    return r.get("noise", 0) if r["run"].startswith("noisy_") else 0


def summary(results: list[dict]) -> str:
    """Markdown (the README's): a row per run and noise, a cell per seed 0 and 1: the reward's first-4 → last-4
    means, **no** when the run did not learn, and its worst fall when that was FALL or more; then, where
    other seeds ran, how many of them learned (and which fell FALL or more)."""
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    by = {(r["run"], noise_of(r), r["seed"]): r for r in results}
    extra = sorted({r["seed"] for r in results} - set(MAIN_SEEDS))

    def cell(r: dict | None) -> str:
        if r is None:
            return "(not run)"
        rw, fall = r["rewards"], drawdown(r["rewards"])
        return (f"{mean(rw[:4]):.2f} → {mean(rw[-4:]):.2f}" + ("" if r["learned"] else " **no**")
                + (f", fell {fall:.2f}" if fall >= FALL else ""))

    def more(rs: list[dict]) -> str:
        if not rs:
            return ""
        no = [f"s{r['seed']}" for r in rs if not r["learned"]]
        fell = [f"s{r['seed']} {drawdown(r['rewards']):.2f}" for r in rs if drawdown(r["rewards"]) >= FALL]
        return (f"{len(rs) - len(no)} of {len(rs)}" + (f"; **no**: {', '.join(no)}" if no else "")
                + (f"; fell: {', '.join(fell)}" if fell else ""))

    head = "| loss / correction | logit noise σ | " + " | ".join(f"seed {s}" for s in MAIN_SEEDS)
    rows = [head + (f" | seeds {extra[0]}-{extra[-1]}: learned |" if extra else " |"),
            "|---|---:|" + "---|" * (len(MAIN_SEEDS) + bool(extra))]
    for run, noise in dict.fromkeys((r["run"], noise_of(r)) for r in results):
        cells = [cell(by.get((run, noise, s))) for s in MAIN_SEEDS]
        if extra:
            cells.append(more([by[(run, noise, s)] for s in extra if (run, noise, s) in by]))
        rows.append(f"| {LABELS.get(run, run)} | {noise:g} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def by_commit(results: list[dict]) -> str:
    """One line: which runs ran at which commit, with the load average (1 min) around them."""
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(r.get("git_commit") or "?", []).append(r)
    parts = []
    for commit, rs in groups.items():
        loads = [x for r in rs for x in r.get("load_avg_1m", [])]
        load = f", load {min(loads):g}-{max(loads):g}" if loads else ""
        names = ("every run" if len(groups) == 1 else f"{len(rs)} runs" if len(rs) > 6 else
                 ", ".join(f"{r['run']}{f' σ{noise_of(r):g}' if noise_of(r) else ''} s{r['seed']}" for r in rs))
        note = next((r["commit_note"] for r in rs if r.get("commit_note")), "")
        parts.append(f"{names} at `{commit}`" + (f" ({note})" if note else "") + load)
    return "_Runs: " + "; ".join(parts) + "._"


def markdown(result: dict, key: str) -> str:
    """What bench/render.py puts between ``<!-- bench:offpolicy:KEY -->`` markers: ``summary`` or ``table``."""
    tables = {"summary": grid_summary, "table": grid_table} if result.get("version") == 2 else {"summary": summary,
                                                                                                  "table": table}
    if key not in tables:
        raise ValueError(f"bench/offpolicy.py renders no {key!r}: one of {', '.join(tables)}")
    return tables[key](result["runs"]) + "\n\n" + by_commit(result["runs"])


def provenance(results: list[dict]) -> dict:
    """bench/render.py's provenance object for the file: the oldest commit among the runs' (so its
    "changed since" covers every run), and the inputs this script declares."""
    def when(commit: str) -> int:
        out = git(["show", "-s", "--format=%ct", commit.removesuffix("-dirty")], ROOT).stdout.strip()
        return int(out) if out.isdigit() else 0

    commits = {r.get("git_commit") or "" for r in results}
    oldest = min(commits, key=when)
    full = git(["rev-parse", oldest.removesuffix("-dirty")], ROOT).stdout.strip() or None
    date = min((r.get("date") or "") for r in results if (r.get("git_commit") or "") == oldest)
    return {"git_commit": oldest.removesuffix("-dirty") or None, "git_commit_full": full,
            "git_dirty": any(c.endswith("-dirty") for c in commits), "date": date or None, "mode": "full",
            "inputs": list(declared_inputs(Path(__file__).resolve(), ROOT))}


def merged(sources: list[Path]) -> list[dict]:
    """Every run recorded in ``DIR/runs.jsonl`` of each source folder, or in a results file (``offpolicy.json``);
    a later source replaces an earlier same run, noise and seed."""
    runs: dict = {}
    for src in sources:
        if src.suffix == ".json":
            rows = json.loads(src.read_text())["runs"]
        else:
            rows = [json.loads(line) for line in (src / "runs.jsonl").read_text().splitlines()]
        for r in rows:
            runs[(r["run"], noise_of(r), r["seed"])] = r
    return sorted(runs.values(), key=lambda r: (list(RUNS).index(r["run"]), r["noise"], r["seed"]))


def _is_grid(sources: list[Path]) -> bool:
    src = sources[0]
    if src.suffix == ".json":
        return json.loads(src.read_text()).get("version") == 2
    first = (src / "runs.jsonl").read_text().splitlines()[:1]
    return bool(first) and "condition" in json.loads(first[0])


def grid_main(args, ap) -> None:
    """Run (or with --merge, join) issue 74's grid; write ``offpolicy.json`` (version 2) to --out."""
    if args.merge:
        runs: dict = {}
        for src in args.merge:
            rows = (json.loads(src.read_text())["runs"] if src.suffix == ".json"
                    else [json.loads(line) for line in (src / "runs.jsonl").read_text().splitlines()])
            runs.update({(r["condition"], r["run"], r["seed"]): r for r in rows})
        results = list(runs.values())
    else:
        todo = [(c, m, int(s), args.steps) for c in args.conditions.split(",") for m in args.methods.split(",")
                for s in args.seeds.split(",")]
        for c, m, _, _ in todo:
            if c not in CONDITIONS or m not in METHODS:
                ap.error(f"unknown condition {c!r} or method {m!r}; known: {', '.join(CONDITIONS)}; {', '.join(METHODS)}")
        info = commit_info(ROOT, declared_inputs(Path(__file__).resolve(), ROOT))
        commit = info["git_commit"] + ("-dirty" if info["git_dirty"] else "")
        load0 = os.getloadavg()[0]
        args.out.mkdir(parents=True, exist_ok=True)
        results = []
        with ProcessPoolExecutor(args.jobs) as pool, open(args.out / "runs.jsonl", "a") as partial:
            for fut in as_completed([pool.submit(grid_one, *t) for t in todo]):  # each run kept as it ends
                r = fut.result()
                r.update(git_commit=commit, date=time.strftime("%Y-%m-%d", time.gmtime()),
                         load_avg_1m=[round(load0, 2), round(os.getloadavg()[0], 2)])
                results.append(r)
                partial.write(json.dumps(r) + "\n")
                partial.flush()
    results.sort(key=lambda r: (list(CONDITIONS).index(r["condition"]), list(METHODS).index(r["run"]), r["seed"]))
    dupes = duplicate_curves(results)
    if dupes:
        print(f"warning: identical curves under different settings: {dupes}", file=sys.stderr)
    out = {"version": 2, "bar": BAR, "provenance": provenance(results), "runs": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "offpolicy.json").write_text(json.dumps(out, indent=1) + "\n")
    plot_grid(results, args.out / "offpolicy.png")
    print(grid_table(results), file=sys.stderr)
    print(grid_summary(results), file=sys.stderr)


def plot_grid(results: list[dict], path: Path) -> None:
    """One panel per condition: each method's reward per step, the mean over its seeds (the control in black)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conditions = [c for c in CONDITIONS if any(r["condition"] == c for r in results)]
    fig, axes = plt.subplots(1, len(conditions), figsize=(8 * len(conditions), 4.5), squeeze=False)
    for ax, cond in zip(axes[0], conditions):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)
        for method in METHODS:
            curves = [r["rewards"] for r in results if r["condition"] == cond and r["run"] == method]
            if not curves:
                continue
            mean = [sum(c[i] for c in curves) / len(curves) for i in range(min(map(len, curves)))]
            style = {"color": "black", "linewidth": 2.5} if method == "control" else {}
            ax.plot(mean, label=f"{method} ({len(curves)} seeds)", **style)
        ax.set(xlabel="step", ylabel="mean reward over seeds", ylim=(0, 1),
               title=f"{cond}: S = {COMMON['stale']} stale, {COMMON['trainer']['minibatches']} minibatches")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--noise", type=float, default=1.0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/offpolicy"))
    ap.add_argument("--grid", action="store_true", help="issue 74's grid: --conditions x --methods x --seeds")
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--merge", type=Path, nargs="*",
                    help="run nothing: write --out/offpolicy.json and the plot of these --out folders or offpolicy.json files")
    args = ap.parse_args()
    if args.grid or (args.merge and _is_grid(args.merge)):
        return grid_main(args, ap)
    if args.merge:
        results = merged(args.merge)
        out = {"bar": BAR, "provenance": provenance(results), "runs": results}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "offpolicy.json").write_text(json.dumps(out, indent=1) + "\n")
        plot(results, args.out / "offpolicy.png")
        print(table(results), file=sys.stderr)
        print(json.dumps(out))
        return
    todo = []
    for item in (n for n in args.runs.split(",") if n):  # NAME (every --seeds) or NAME:SEED
        name, _, seed = item.partition(":")
        if name not in RUNS:
            ap.error(f"--runs: unknown {name}; known: {', '.join(RUNS)}")
        todo += [(name, int(s), args.steps, args.noise) for s in (seed.split() or args.seeds.split(","))]
    t0, load0 = time.time(), os.getloadavg()[0]
    info = commit_info(ROOT, declared_inputs(Path(__file__).resolve(), ROOT))
    commit = info["git_commit"] + ("-dirty" if info["git_dirty"] else "")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with ProcessPoolExecutor(args.jobs) as pool, open(args.out / "runs.jsonl", "a") as partial:
        for fut in as_completed([pool.submit(one, *t) for t in todo]):  # each run kept as it ends
            results.append(fut.result())
            results[-1].update(git_commit=commit, date=time.strftime("%Y-%m-%d", time.gmtime()),
                               load_avg_1m=[round(load0, 2), round(os.getloadavg()[0], 2)])
            partial.write(json.dumps({"noise": args.noise, "steps": args.steps, **results[-1]}) + "\n")
            partial.flush()
    results.sort(key=lambda r: (list(RUNS).index(r["run"]), r["seed"]))
    for r in results:
        r["noise"] = args.noise
    print(table(results), file=sys.stderr)
    out = {"noise": args.noise, "steps": args.steps, "bar": BAR, "seconds": round(time.time() - t0, 1),
           "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)], "provenance": provenance(results),
           "runs": results}
    (args.out / "offpolicy.json").write_text(json.dumps(out, indent=1))
    plot(results, args.out / "offpolicy.png")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
