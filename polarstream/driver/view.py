"""The terminal view of a run: a live table of its latest steps, with held-out pass@1 and consumer lag."""

from __future__ import annotations

from .config import RunConfig
from .report import dash
from .results import StepResult


def table(cfg: RunConfig, results: list[StepResult], lag: dict[str, int], status: str,
          heldout: dict[str, float] | None = None):
    """The last 12 steps (reward, entropy, grad norm, samples, tokens/s, merge rate, policy, its weight sync's
    seconds and how it went) as a rich Table."""
    from rich.table import Table

    t = Table(title=f"polarstream {cfg.name} - {status}", expand=False)
    for col in ("step", "reward", "entropy", "grad norm", "samples", "tokens/s", "merge rate", "policy", "sync s"):
        t.add_column(col, justify="right")
    for r in results[-12:]:
        t.add_row(str(r.step), f"{r.reward:.2f}", dash(r.entropy, ".3f"), dash(r.grad_norm, ".2f"), str(r.samples),
                  f"{r.sampled_tokens / max(r.wall_s, 1e-9):.0f}", f"{r.merge_rate:.0%}", str(r.policy_version),
                  f"{dash(r.sync_s, '.2f')} {r.sync_mode or ''}".strip())
    held = ", ".join(f"{k} {v:.2f}" for k, v in (heldout or {}).items()) or "-"
    t.caption = (f"held-out pass@1: {held}\n"
                 "consumer lag: " + (", ".join(f"{k}={v}" for k, v in sorted(lag.items())) or "-"))
    return t
