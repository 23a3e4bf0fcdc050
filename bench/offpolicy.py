"""Off-policy losses and corrections on the in-process demo loop (issue 65): does each learn, and does a
correction keep learning where an engine/trainer mismatch degrades plain PPO?

    .venv/bin/python bench/offpolicy.py [--runs NAME,...] [--seeds 0,1] [--steps 20] [--noise SIGMA]
                                        [--jobs 2] [--out DIR]

Every run is ``polarstream.demo.learning.rl_run`` as tests/demo/test_learning.py runs it (its cached warm
start, every problem every step, lr 1.2e-3, 8 samples, one torch thread per run), with one setting
changed. ``--noise`` is the sampler's ``logit_noise`` (the engine's ``--logit-noise``) for the runs
named ``noisy_*``: the sampler samples from, and reports logprobs of, logits + N(0, sigma^2).
A run learns when its last-4 mean reward is at least its first-4 mean + 0.2 (the test's bar). Prints one
JSON object (every run's rewards and per-step mismatch metrics); writes it and a plot (reward and
mismatch k3 per step) to ``--out``. Not part of ``make bench`` (a full run is ~20-40 min of 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# name -> LearningConfig overrides; noisy_* also get logit_noise = --noise
RUNS = {
    "ppo_clip": {},
    "gspo": {"loss": "gspo", "loss_norm": "seq_mean"},
    "cispo": {"loss": "cispo"},
    "icepop": {"correction": "icepop"},
    "seq_mask_geo": {"correction": "seq_mask_geo"},
    "no_std": {"std_normalize": False},
    "noisy_ppo_clip": {},
    "noisy_icepop": {"correction": "icepop"},
    "noisy_seq_mask_geo": {"correction": "seq_mask_geo"},
    "noisy_tis": {"correction": "tis", "trainer": {"tis_cap": 2.0}},
}
BAR = 0.2
KEEP = ("mismatch_k3", "mismatch_ratio_max", "mismatch_ratio_p99", "corrected_frac", "clip_frac",
        "would_icepop_frac", "would_seq_mask_geo_frac")


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
            "seconds": round(time.time() - t0, 1),
            "mismatch": {k: [round(s.mismatch.get(k, 0.0), 6) for s in log.steps] for k in KEEP}}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        style = "-" if r["seed"] == 0 else "--"
        line, = ax1.plot(r["rewards"], style, label=f"{r['run']} s{r['seed']}")
        ax2.plot(r["mismatch"]["mismatch_k3"], style, color=line.get_color())
    ax1.set(xlabel="step", ylabel="mean reward", title="reward")
    ax2.set(xlabel="step", ylabel="k3 KL(rollout || trainer) per token", title="mismatch")
    ax2.set_yscale("symlog", linthresh=1e-6)
    ax1.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--noise", type=float, default=1.0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/offpolicy"))
    args = ap.parse_args()
    names = [n for n in args.runs.split(",") if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        ap.error(f"--runs: unknown {', '.join(unknown)}; known: {', '.join(RUNS)}")
    todo = [(n, int(s), args.steps, args.noise) for n in names for s in args.seeds.split(",")]
    t0, load0 = time.time(), os.getloadavg()[0]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(one, *zip(*todo)))
    for r in results:
        print(f"{r['run']:>20} seed {r['seed']}: learned={r['learned']} rewards {r['rewards']}", file=sys.stderr)
    out = {"noise": args.noise, "steps": args.steps, "bar": BAR, "seconds": round(time.time() - t0, 1),
           "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)], "runs": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "offpolicy.json").write_text(json.dumps(out, indent=1))
    plot(results, args.out / "offpolicy.png")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
