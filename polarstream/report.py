"""The demo's report: reward curve (PNG), a markdown summary, and demo-summary.json."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from infra.settings import Settings
from schemas import PolicyVersion

if TYPE_CHECKING:
    from .demo import DemoConfig, StepResult


def quarter_means(rewards: list[float]) -> tuple[float, float]:
    """Mean reward over the first and the last quarter of steps (at least one step each)."""
    q = max(1, len(rewards) // 4)
    return sum(rewards[:q]) / q, sum(rewards[-q:]) / q


def plot_rewards(rewards: list[float], path: Path) -> None:
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
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward (task solved)")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("polarstream demo: reward while training")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(run_dir: Path, cfg: "DemoConfig", results: list["StepResult"], policy: PolicyVersion | None,
                 settings: Settings, wall_s: float, model_dir: Path) -> Path:
    """Write reward.png, report.md and demo-summary.json into ``run_dir``; returns the summary's path."""
    rewards = [r.reward for r in results]
    first, last = quarter_means(rewards) if rewards else (0.0, 0.0)
    plot_rewards(rewards, run_dir / "reward.png")
    env = f"POLAR_KAFKA_BOOTSTRAP={settings.kafka_bootstrap} POLAR_TOPIC_PREFIX={shlex.quote(settings.topic_prefix)}"
    commands = {
        "replay": f"{env} polarstream replay --from-time 0 --to-prefix ablation-per-request --builder per_request",
        "eval": f"{env} polarstream eval --out {shlex.quote(str(run_dir / 'eval'))}",
        "export": f"{env} polarstream export --format jsonl --out {shlex.quote(str(run_dir / 'sft.jsonl'))}",
    }
    summary = {
        "steps": len(results),
        "reward_per_step": rewards,
        "first_quarter_mean": first,
        "last_quarter_mean": last,
        "learned": last > first,
        "wall_time_s": round(wall_s, 1),
        "checkpoint_url": policy.checkpoint_url if policy else None,
        "policy_version": policy.version if policy else None,
        "model_dir": str(model_dir),
        "topic_prefix": settings.topic_prefix,
        "kafka_bootstrap": settings.kafka_bootstrap,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "per_step": [{**asdict(r), "merge_rate": r.merge_rate} for r in results],
        "commands": commands,
    }
    path = run_dir / "demo-summary.json"
    path.write_text(json.dumps(summary, indent=2))
    rows = "\n".join(
        f"| {r.step + 1} | {r.reward:.3f} | {r.samples} | {r.traces} | {r.calls} | {r.merge_rate:.0%} | "
        f"{r.sampled_tokens} | {r.wall_s:.1f} | {r.policy_version} |" for r in results)
    (run_dir / "report.md").write_text(f"""# polarstream demo report

![reward per step](reward.png)

- steps: {len(results)}, groups per step: {cfg.tasks_per_step}, samples per group: {cfg.samples}, harness: {cfg.harness}
- mean reward, first quarter of steps: **{first:.3f}**; last quarter: **{last:.3f}**
- wall time: {wall_s / 60:.1f} min
- checkpoints: `{summary['checkpoint_url']}` (policy version {summary['policy_version']})
- topics: prefix `{settings.topic_prefix}` on `{settings.kafka_bootstrap}`

## Per step

| step | reward | samples | traces | calls | merge rate | sampled tokens | wall s | policy |
|---:|---:|---:|---:|---:|---:|---:|---:|---:|
{rows}

## Replay and evaluate this run

```
{commands['replay']}
{commands['eval']}
{commands['export']}
```
""")
    return path
