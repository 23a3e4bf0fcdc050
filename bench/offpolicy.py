"""Off-policy losses and corrections on the in-process demo loop (issue 65): does each learn, and does a
correction keep learning where an engine/trainer mismatch degrades plain PPO?

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
MEASURES = ("trainer/", "polarstream/demo/", "streams/advantages.py", "tests/demo/test_learning.py")

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
    cfg = LearningConfig(steps=steps, samples=8, lr=1.2e-3, seed=seed, all_problems=True, **settings)
    t0 = time.time()
    log, _ = rl_run(_warm(WARM_HALF_TOOL), PROBLEMS, cfg, system=SYSTEM, tools=TOOLS)
    rewards = [round(r, 4) for r in log.rewards]
    return {"run": name, "seed": seed, "settings": settings, "rewards": rewards, "learned": learned(rewards),
            "seconds": round(time.time() - t0, 1), "tokens": [s.tokens for s in log.steps],
            "mismatch": {k: [round(s.mismatch.get(k, 0.0), 6) for s in log.steps] for k in KEEP}}


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
    tables = {"summary": summary, "table": table}
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--noise", type=float, default=1.0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/offpolicy"))
    ap.add_argument("--merge", type=Path, nargs="*",
                    help="run nothing: write --out/offpolicy.json and the plot of these --out folders or offpolicy.json files")
    args = ap.parse_args()
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
