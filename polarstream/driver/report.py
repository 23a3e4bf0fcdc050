"""A run's report: its reward curve (reward.png), a markdown summary (report.md) and demo-summary.json (the
name it had when the demo was the only run), with the bars a run of the arith family must clear to count
as learned; run-summary.json, an experiment's summary of it."""

from __future__ import annotations

import json
import shlex
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING

from infra.settings import Settings
from schemas import PolicyVersion

if TYPE_CHECKING:
    from .config import RunConfig
    from .experiment import Experiment
    from .results import StepResult


# What a demo run must show to count as learned (README, issue "Training that learns, every time").
BARS = {"reward_gain": 0.3, "last_quarter": 0.6, "heldout_gain": 0.2, "wall_time_s": 600.0}
# A real CLI's run (issue "An unmodified real CLI learns"): its prompt is about 4x the built-in one and each
# session starts a Node.js process, so it gets 15 minutes; its sessions that write go on after the tool
# result, so some prefix merging must show.
CLI_BARS = {"reward_gain": 0.3, "heldout_gain": 0.2, "wall_time_s": 900.0, "merge_rate": 0.0}


def bars(harness: str) -> dict[str, float]:
    return BARS if harness == "builtin" else CLI_BARS



def quarter_means(rewards: list[float]) -> tuple[float, float]:
    """Mean reward over the first and the last quarter of steps (at least one step each)."""
    q = max(1, len(rewards) // 4)
    return sum(rewards[:q]) / q, sum(rewards[-q:]) / q


def dash(value: float | None, spec: str) -> str:
    """``value`` formatted with ``spec``, or "-" where there is none (a step the trainer reported nothing for)."""
    return "-" if value is None else format(value, spec)


def worst_fall(rewards: list[float], reach: float = 0.8) -> float | None:
    """How far the 2-step mean reward fell below its best so far, at worst, once it first reached ``reach``
    (None if it never did). Issue 48's rule for a run that stays learned: at most 0.3."""
    means = [(a + b) / 2 for a, b in zip(rewards, rewards[1:])]
    first = next((i for i, m in enumerate(means) if m >= reach), None)
    if first is None:
        return None
    best, worst = means[first], 0.0
    for m in means[first:]:
        best = max(best, m)
        worst = max(worst, best - m)
    return worst


def plot_rewards(rewards: list[float], path: Path, heldout: dict[str, float] | None = None,
                 entropy: list[float | None] | None = None, name: str = "demo") -> None:
    """The reward per step (and its moving average, held-out pass@1, entropy) of run ``name`` as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=120)
    steps = list(range(1, len(rewards) + 1))
    ax.plot(steps, rewards, marker="o", lw=1, ms=3, label="mean reward per step")
    window = 4
    if len(rewards) >= window:
        smooth = [sum(rewards[i - window + 1 : i + 1]) / window for i in range(window - 1, len(rewards))]
        ax.plot(steps[window - 1 :], smooth, lw=2, label=f"{window}-step moving average")
    if heldout and "before" in heldout and "after" in heldout:  # before training at step 0, after it at the end
        ax.plot([0, len(rewards)], [heldout["before"], heldout["after"]], ls="--", marker="s", ms=6, color="tab:green",
                label="held-out pass@1 (before / after)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward (task solved)")
    if entropy and any(e is not None for e in entropy):  # beside the reward: a collapse shows in both
        ax2 = ax.twinx()
        pts = [(i + 1, e) for i, e in enumerate(entropy) if e is not None]
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], color="tab:purple", lw=1, ls=":", marker=".", ms=3,
                 label="policy entropy (trained tokens, right axis)")
        ax2.set_ylabel("entropy (nats / token)", color="tab:purple")
        ax2.set_ylim(bottom=0)
        ax2.legend(loc="lower right", fontsize=7)
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    title = f"polarstream {name}: reward while training"
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, metadata={"Title": title})  # the PNG says which run it is drawn from, also to a program
    plt.close(fig)


def bars_met(first: float, last: float, heldout: dict[str, float], wall_s: float, harness: str = "builtin",
             merge_rate: float = 0.0) -> dict[str, bool]:
    """Each bar a demo run must clear to count as learned (``bars``: the built-in harness's, or a real CLI's)."""
    bar = bars(harness)
    gain = heldout.get("after", 0.0) - heldout.get("before", 0.0)
    met = {"reward_gain": last - first >= bar["reward_gain"], "heldout_gain": gain >= bar["heldout_gain"],
           "wall_time": wall_s <= bar["wall_time_s"]}
    if "last_quarter" in bar:
        met["last_quarter"] = last >= bar["last_quarter"]
    if "merge_rate" in bar:
        met["merge_rate"] = merge_rate > bar["merge_rate"]
    return met


def write_report(run_dir: Path, cfg: "RunConfig", results: list["StepResult"], policy: PolicyVersion | None,
                 settings: Settings, wall_s: float, model_dir: Path, heldout: dict[str, float] | None = None,
                 warm: dict | None = None, total_s: float | None = None, viewer_url: str = "",
                 extra: dict | None = None, preset_lines: Callable[[dict], list[str]] | None = None) -> Path:
    """Write reward.png, report.md and demo-summary.json into ``run_dir``; returns the summary's path.

    ``wall_s`` is the run after the warm start (cached after the first run); ``total_s`` includes it.
    ``viewer_url``: the run's ``polarstream ui``; each step's groups link to their pages there.
    ``extra``: more of the summary (the loop's figures); ``preset_lines(summary)``: the preset's own lines
    in report.md's list (preset.py).
    """
    heldout = heldout or {}
    rewards = [r.reward for r in results]
    first, last = quarter_means(rewards) if rewards else (0.0, 0.0)
    from .results import merge_rate as rate

    merge_rate = rate(sum(r.traces for r in results), sum(r.calls for r in results))
    bars = bars_met(first, last, heldout, wall_s, cfg.harness, merge_rate)
    plot_rewards(rewards, run_dir / "reward.png", heldout, [r.entropy for r in results], cfg.name)
    fall = worst_fall(rewards)
    env = f"POLAR_KAFKA_BOOTSTRAP={settings.kafka_bootstrap} POLAR_TOPIC_PREFIX={shlex.quote(settings.topic_prefix)}"
    commands = {
        "replay": f"{env} polarstream replay --from-time 0 --to-prefix ablation-per-request --builder per_request",
        "eval": f"{env} polarstream eval --out {shlex.quote(str(run_dir / 'eval'))}",
        "export": f"{env} polarstream export --format jsonl --out {shlex.quote(str(run_dir / 'sft.jsonl'))}",
    }
    summary = {
        "seed": cfg.seed,
        "steps": len(results),
        "reward_per_step": rewards,
        "first_quarter_mean": first,
        "last_quarter_mean": last,
        "heldout_before": heldout.get("before"),
        "heldout_after": heldout.get("after"),
        "warm_start_train_pass_rate": (warm or {}).get("train_pass_rate"),
        "bars": bars,
        "learned": all(bars.values()),
        "worst_fall_after_0.8": None if fall is None else round(fall, 3),  # issue 48: at most 0.3
        "harness": cfg.harness if cfg.harness == "builtin" else f"{cfg.harness} ({cfg.api})",
        "merge_rate": round(merge_rate, 3),
        "wall_time_s": round(wall_s, 1),
        "total_time_s": round(total_s if total_s is not None else wall_s, 1),
        "checkpoint_url": policy.checkpoint_url if policy else None,
        "policy_version": policy.version if policy else None,
        "model_dir": str(model_dir),
        "topic_prefix": settings.topic_prefix,
        "kafka_bootstrap": settings.kafka_bootstrap,
        # groups without signal, by kind (masked: they move no weight; or dropped and replaced)
        "zero_signal_groups": {"all_correct": sum(r.all_correct for r in results), "all_wrong": sum(r.all_wrong for r in results),
                               "replaced": sum(r.replaced for r in results), "groups": sum(r.groups for r in results)},
        # members masked with a reason (a judge failure's class; docs/rewards.md), over the run
        "masked_reasons": dict(sorted(sum((Counter(r.masked_reasons) for r in results), Counter()).items())),
        "heldout_per_eval": heldout,  # every eval: before, "step N" (eval_every), after
        **(extra or {}),  # the training loop's span, steps per hour, the engine's idle fraction
        # a user's run names its tasks by count: the templates themselves are in their source
        "config": {k: str(v) if isinstance(v, Path) else len(v) if k.endswith("_tasks") and v is not None
                   else sorted(v) if isinstance(v, frozenset) else v
                   for k, v in ((f.name, getattr(cfg, f.name)) for f in fields(cfg))},
        "warm_start": warm or {},
        "per_step": [{**asdict(r), "merge_rate": r.merge_rate} for r in results],
        "commands": commands,
    }
    path = run_dir / "demo-summary.json"
    path.write_text(json.dumps(summary, indent=2))
    rows = "\n".join(
        f"| {r.step + 1} | {r.reward:.3f} | {dash(r.entropy, '.4f')} | {dash(r.grad_norm, '.3f')} | {dash(r.lr, '.2e')} | "
        f"{dash(r.mismatch_k3, '.1e')} | {dash(r.ratio_max, '.2f')} | {dash(r.ratio_p99, '.3f')} | {dash(r.corrected_frac, '.3f')} | "
        f"{r.samples} | {r.traces} | {r.calls} | {r.merge_rate:.0%} | "
        f"{r.sampled_tokens} | {r.wall_s:.1f} | {r.policy_version} | {dash(r.sync_s, '.3f')} | {r.sync_mode or '-'} | "
        f"{dash(r.engine_pause_s, '.3f')} | {group_links(viewer_url, r.group_ids)} |"
        for r in results)
    fmt = lambda v: dash(v, ".3f")  # noqa: E731
    own = "".join(f"{line}\n" for line in (preset_lines(summary) if preset_lines is not None else ()))
    (run_dir / "report.md").write_text(f"""# polarstream {cfg.name} report

![reward per step](reward.png)

- seed {cfg.seed}; steps: {len(results)}, groups per step: {cfg.tasks_per_step}, samples per group: {cfg.samples}, harness: {cfg.harness}
- mean reward, first quarter of steps: **{first:.3f}**; last quarter: **{last:.3f}**
- held-out pass@1 ({cfg.heldout} problems never trained on, {cfg.heldout_samples} samples each, read back with
  `polarstream eval`): before training **{fmt(heldout.get('before'))}**, after **{fmt(heldout.get('after'))}**
{own}- learned: **{summary['learned']}** ({', '.join(f"{k} {'ok' if v else 'missed'}" for k, v in bars.items())})
- stays learned: once the 2-step mean reward first reached 0.8, it fell at most
  **{fmt(fall)}** below its best so far (issue 48's rule: at most 0.3)
- wall time: {wall_s / 60:.1f} min after the warm start ({summary['total_time_s'] / 60:.1f} min in all)
- checkpoints: `{summary['checkpoint_url']}` (policy version {summary['policy_version']})
- topics: prefix `{settings.topic_prefix}` on `{settings.kafka_bootstrap}`
- viewer: {viewer_url or "-"} while the run goes on; afterwards `{env} polarstream ui` shows the same pages

## Per step

Mismatch: k3 KL(rollout || trainer) per trained token; ratio: pi_trainer / pi_rollout over the trained tokens
(max, 99th percentile); corrected: the share the trainer's correction ({cfg.correction}) masked or capped.

| step | reward | entropy | grad norm | lr | mismatch | ratio max | ratio p99 | corrected | samples | traces | calls | merge rate | sampled tokens | wall s | policy | sync s | sync | engine pause s | groups |
|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|
{rows}

## Replay and evaluate this run

```
{commands['replay']}
{commands['eval']}
{commands['export']}
```
""")
    return path


def group_links(viewer_url: str, group_ids: list[str]) -> str:
    """Markdown links from a step to its groups' viewer pages (``t0 t1 ...``: the task's number in the step)."""
    from polarstream.viewer.pages import url

    if not viewer_url:
        return " ".join(f"`{g}`" for g in group_ids)
    return " ".join(f"[{g.rsplit('-', 1)[-1]}]({viewer_url.rstrip('/')}{url(0, 'group', g)})" for g in group_ids)


def write_run_summary(exp: "Experiment", cfg: "RunConfig", demo_summary_path: Path, total_s: float) -> Path:
    """run-summary.json beside demo-summary.json: what an experiment file's run gave, under the file's names
    (its train and eval sources, eval metric and cadence); returns its path."""
    demo_summary = json.loads(demo_summary_path.read_text())
    summary = {
        "name": exp.name, "run_id": cfg.run_id, "async_level": exp.async_level, "seed": exp.seed, "train": exp.train, "eval": exp.eval,
        "reward_per_step": demo_summary["reward_per_step"],
        "eval_before": demo_summary.get("heldout_before"), "eval_after": demo_summary.get("heldout_after"),
        "eval_metric": "pass@1", "eval_samples": exp.eval_samples,
        "eval_per_version": demo_summary.get("heldout_per_eval"), "eval_metrics": demo_summary.get("heldout_metrics"), "zero_signal_groups": demo_summary.get("zero_signal_groups"),
        "order": exp.order, "steps": len(demo_summary["reward_per_step"]), "per_task": demo_summary.get("per_task"),
        "retired": demo_summary.get("retired"),
        "rl_wall_time_s": demo_summary["wall_time_s"],
        # over the training loop (first step out to last step trained), as the driver's loop measured them
        **{k: demo_summary.get(k) for k in ("rl_loop_s", "steps_per_hour", "engine_idle_fraction", "session_stage_s")},
        "total_s": round(total_s, 1), "demo_summary": "demo-summary.json",
    }
    path = cfg.run_dir / "run-summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return path
