"""The README's tables of runs, rendered from their summaries (each run's demo-summary.json, kept in
docs/demo-runs/ and docs/experiment-runs/): the demo's seeds, ``polarstream run`` at each async level, real
CLIs' runs and their step timings. tests/demo/test_runs_table.py fails when a table is stale."""

from __future__ import annotations

import json
from pathlib import Path

from .report import dash, worst_fall


RUNS_START, RUNS_END = "<!-- demo:runs -->", "<!-- /demo:runs -->"


def learned_cell(summary: dict) -> str:
    """"yes", or "no: " and the bars a run missed (every runs table's last column)."""
    return "yes" if summary["learned"] else "no: " + ", ".join(k for k, v in summary["bars"].items() if not v)


DEMO_RUNS = ("seed*.json", "lora-seed*.json")  # docs/demo-runs/: `polarstream demo --seed N` [--lora]


def demo_run_summaries(root: Path) -> list[dict]:
    """The committed summaries of the README's demo table (``DEMO_RUNS`` under docs/demo-runs/)."""
    return [json.loads(p.read_text()) for pattern in DEMO_RUNS for p in sorted((root / "docs" / "demo-runs").glob(pattern))]


def _lora(s: dict) -> dict:
    return (s.get("config") or {}).get("lora") or {}


def runs_table(summaries: list[dict]) -> str:
    """One row per demo run: seed (and the adapter of a ``--lora`` run, after the full-weight rows), quarters,
    held-out before/after, wall time, learned."""
    rows = ["| seed | first quarter | last quarter | held-out pass@1 before | after | worst fall after 0.8 "
            "| wall time after the warm start | learned |",
            "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in sorted(summaries, key=lambda s: (bool(_lora(s)), s["seed"])):
        lora = _lora(s)
        seed = f"{s['seed']}, LoRA r{lora['rank']}" if lora else s["seed"]
        rows.append(f"| {seed} | {_curve_cells(s)} | {s['wall_time_s'] / 60:.1f} min | {learned_cell(s)} |")
    return "\n".join(rows)


def _curve_cells(s: dict) -> str:
    """A run's quarters, held-out pass@1 before and after, and worst fall after 0.8, as table cells."""
    fall = worst_fall(s["reward_per_step"]) if s.get("reward_per_step") else s.get("worst_fall_after_0.8")
    return (f"{s['first_quarter_mean']:.3f} | {s['last_quarter_mean']:.3f} | {s['heldout_before']:.3f} | "
            f"{s['heldout_after']:.3f} | {dash(fall, '.2f')}")


ASYNC_RUNS_START, ASYNC_RUNS_END = "<!-- run:async -->", "<!-- /run:async -->"


def async_runs_table(summaries: list[dict]) -> str:
    """One row per ``polarstream run`` of the arith family: its async level S, seed, quarters, held-out
    pass@1, worst fall, RL wall time and steps per hour (from each run's demo-summary.json)."""
    rows = ["| S | seed | first quarter | last quarter | held-out pass@1 before | after | worst fall after 0.8 "
            "| RL wall time | steps/hour | learned |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in sorted(summaries, key=lambda s: (s["config"]["async_level"], s["seed"])):
        rows.append(f"| {s['config']['async_level']} | {s['seed']} | {_curve_cells(s)} | {s['wall_time_s'] / 60:.1f} min | "
                    f"{s['steps'] / s['wall_time_s'] * 3600:.0f} | {learned_cell(s)} |")
    return "\n".join(rows)


IMAGE_RUNS_START, IMAGE_RUNS_END = "<!-- run:image -->", "<!-- /run:image -->"
JUDGE_RUNS_START, JUDGE_RUNS_END = "<!-- run:judge -->", "<!-- /run:judge -->"  # examples/judge_arith.yaml


def image_runs_table(summaries: list[dict]) -> str:
    """One row per seed of an experiment run (the arith family as image tasks, examples/image_arith.py; with a
    judge as its only reward, examples/judge_arith.yaml): seed, quarters, held-out pass@1, worst fall, RL wall
    time, steps/hour."""
    rows = ["| seed | first quarter | last quarter | held-out pass@1 before | after | worst fall after 0.8 "
            "| RL wall time | steps/hour | learned |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in sorted(summaries, key=lambda s: s["seed"]):
        rows.append(f"| {s['seed']} | {_curve_cells(s)} | {s['wall_time_s'] / 60:.1f} min | "
                    f"{s['steps'] / s['wall_time_s'] * 3600:.0f} | {learned_cell(s)} |")
    return "\n".join(rows)


CLI_RUNS_START, CLI_RUNS_END = "<!-- demo:cli-runs -->", "<!-- /demo:cli-runs -->"


def cli_runs_table(summaries: list[dict]) -> str:
    """One row per real-CLI demo run (``--harness``): its size, quarters, held-out, merge rate, wall time."""
    rows = ["| harness (API) | seed | steps × tasks × samples | first quarter | last quarter | held-out pass@1 before "
            "| after | merge rate | wall time after the warm start | learned |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for s in sorted(summaries, key=lambda s: (s["harness"], s["seed"])):
        c = s["config"]
        rows.append(f"| {s['harness']} | {s['seed']} | {c['steps']} × {c['tasks_per_step']} × {c['samples']} | "
                    f"{s['first_quarter_mean']:.3f} | {s['last_quarter_mean']:.3f} | {s['heldout_before']:.3f} | "
                    f"{s['heldout_after']:.3f} | {s['merge_rate']:.0%} | {s['wall_time_s'] / 60:.1f} min | "
                    f"{learned_cell(s)} |")
    return "\n".join(rows)


CLI_STEPS_START, CLI_STEPS_END = "<!-- demo:cli-steps -->", "<!-- /demo:cli-steps -->"


def cli_steps_table(summaries: list[dict]) -> str:
    """One row per timing run of a real CLI (one GRPO step of one group): what a step costs with its prompt."""
    rows = ["| harness (API) | CLI | sessions | calls | training tokens per session | sampled tokens | step wall time |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for s in sorted(summaries, key=lambda s: s["harness"]):
        (step,) = s["per_step"]
        version = s["warm_start"].get("shape", "").split(" over ")[0]
        rows.append(f"| {s['harness']} | {version} | {step['samples']} | {step['calls']} | "
                    f"{step['trace_tokens'] / max(step['samples'], 1):,.0f} | {step['sampled_tokens']} | "
                    f"{step['wall_s']:.0f} s |")
    return "\n".join(rows)


def render_block(text: str, start: str, end: str, table: str) -> str:
    """``text`` with the block between ``start`` and ``end`` replaced by ``table``."""
    head, sep, rest = text.partition(start)
    if not sep or end not in rest:
        raise ValueError(f"no {start} ... {end} block")
    return f"{head}{start}\n{table}\n{end}{rest.split(end, 1)[1]}"


def render_runs(text: str, summaries: list[dict]) -> str:
    """``text`` with the block between the demo-run markers replaced by ``runs_table``."""
    return render_block(text, RUNS_START, RUNS_END, runs_table(summaries))


def plot_lora_vs_full(summaries: list[dict], path: Path, window: int = 4) -> None:
    """Each seed that has both a full-weight and a LoRA run: their rewards' ``window``-step moving averages, one
    colour per seed, full weights solid and LoRA dashed (the README's LoRA figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {(s["seed"], bool(_lora(s))): s["reward_per_step"] for s in summaries if s.get("reward_per_step")}
    seeds = sorted(seed for seed, lora in runs if lora and (seed, False) in runs)
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=120)
    for i, seed in enumerate(seeds):
        for lora, style in ((False, "-"), (True, "--")):
            r = runs[(seed, lora)]
            avg = [sum(r[j - window + 1 : j + 1]) / window for j in range(window - 1, len(r))]
            ax.plot(range(window, len(r) + 1), avg, ls=style, color=f"C{i}",
                    label=f"seed {seed}, {'LoRA r16' if lora else 'full weights'}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(f"reward ({window}-step moving average)")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("polarstream demo: LoRA against full weights")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":  # python -m polarstream.driver.runs_table: re-render README's demo table and LoRA figure
    readme = Path(__file__).resolve().parents[2] / "README.md"
    summaries = demo_run_summaries(readme.parent)
    readme.write_text(render_runs(readme.read_text(), summaries))
    plot_lora_vs_full(summaries, readme.parent / "docs" / "demo-reward-lora.png")
