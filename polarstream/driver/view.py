"""The terminal view of a run: a live table of its latest steps, with held-out pass@1 and consumer lag."""

from __future__ import annotations

from .config import RunConfig
from .report import dash
from .results import StepResult


def table(cfg: RunConfig, results: list[StepResult], lag: dict[str, int], status: str,
          heldout: dict[str, float] | None = None):
    """The last 12 steps (reward, entropy, grad norm, the rollout/trainer mismatch as k3, tokens/s, merge rate,
    policy, its weight sync's seconds) as a rich Table that fits an 80-column terminal: samples, the sync's
    path and the mismatch's ratios are in report.md."""
    from rich.table import Table

    t = Table(title=f"polarstream {cfg.name} - {status}", expand=False)
    for col in ("step", "reward", "entropy", "grad", "k3", "tok/s", "merge", "policy", "sync s"):
        t.add_column(col, justify="right")
    for r in results[-12:]:
        t.add_row(str(r.step), f"{r.reward:.2f}", dash(r.entropy, ".3f"), dash(r.grad_norm, ".2f"),
                  dash(r.mismatch_k3, ".0e"), f"{r.sampled_tokens / max(r.wall_s, 1e-9):.0f}",
                  f"{r.merge_rate:.0%}", str(r.policy_version), dash(r.sync_s, ".2f"))
    held = ", ".join(f"{k} {v:.2f}" for k, v in (heldout or {}).items()) or "-"
    t.caption = (f"held-out pass@1: {held}\n"
                 "consumer lag: " + (", ".join(f"{k}={v}" for k, v in sorted(lag.items())) or "-"))
    return t
