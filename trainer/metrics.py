"""Where step metrics go: a JSONL run log (the record), TensorBoard, a progress bar and Prometheus.

The JSONL log is written *before* the step's checkpoint and synced to disk, and every (re)start
writes ``{"event": "start", "step": S}`` with the step it resumed from. A step line logged after the
last checkpoint of a crashed run describes work the crash threw away (the restart redoes it), so
``effective_steps`` drops step lines above each restart's step: what remains is exactly what the
surviving weights were trained on.

Prometheus gauges and counters (``polar_trainer_*``, docs/operations.md) are set on every step and
weight sync of rank 0; ``--metrics-port`` serves them (train.py starts the server on rank 0 only).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

STEPS = Counter("polar_trainer_steps", "Optimizer steps taken (rank 0)")
TOKENS = Counter("polar_trainer_tokens", "Tokens fed through the model, padding included")
TOKENS_PER_S = Gauge("polar_trainer_tokens_per_second", "Tokens per second of the last step")
REWARD = Gauge("polar_trainer_reward_mean", "Mean reward of the trajectories of the last step")
STALENESS = Gauge("polar_trainer_staleness", "Policy versions between the groups of the last step and the "
                  "trained policy", ["stat"])
POLICY_VERSION = Gauge("polar_trainer_policy_version", "Policy version after the last step")
LOSS = Gauge("polar_trainer_loss", "Loss of the last step")
MISMATCH = Gauge("polar_trainer_mismatch_k3", "k3 KL(rollout || trainer) per trained token of the last step: how far "
                 "the engines' policy is from the trained one")
SYNCS = Counter("polar_trainer_syncs", "Weight syncs to the engines, by outcome (ok | failed)", ["outcome"])
SYNC_FAILURES_IN_A_ROW = Gauge("polar_trainer_sync_failures_in_a_row", "Weight syncs failed since the last "
                               "one that succeeded (the trainer stops at max_sync_failures)")


def record_step(metrics: dict[str, float]) -> None:
    """Set the Prometheus metrics from one step's metrics (the dict the run log records)."""
    STEPS.inc()
    TOKENS.inc(metrics["tokens"])
    TOKENS_PER_S.set(metrics["tokens_per_s"])
    REWARD.set(metrics["reward_mean"])
    STALENESS.labels("max").set(metrics["staleness_max"])
    STALENESS.labels("mean").set(metrics["staleness_mean"])
    POLICY_VERSION.set(metrics["policy_version"])
    LOSS.set(metrics["loss"])
    MISMATCH.set(metrics.get("mismatch_k3", 0.0))


def record_sync(ok: bool, failures_in_a_row: int) -> None:
    """One weight sync (PolicyVersion published and engines reloaded), and the failures since a success."""
    SYNCS.labels("ok" if ok else "failed").inc()
    SYNC_FAILURES_IN_A_ROW.set(failures_in_a_row)


class RunLog:
    """Append-only JSONL, one fsync'ed line per event."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, sort_keys=True, default=float) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def read_log(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a run log (a line cut by a crash mid-write is ignored)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def effective_steps(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step records whose updates survive in the final weights (see module docstring)."""
    steps: list[dict[str, Any]] = []
    for r in records:
        if r.get("event") == "start":
            steps = [s for s in steps if s["step"] <= r["step"]]
        elif r.get("event") == "step":
            steps.append(r)
    return steps


class Sinks:
    """TensorBoard + progress bar + Prometheus + one stdout line per step (rank 0 only)."""

    def __init__(self, run_dir: Path, tensorboard: bool, progress: bool, total: int | None, initial: int):
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"))
        self.bar = None
        if progress:  # rich draws a live bar on a terminal and plain lines otherwise (logs, CI)
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                TextColumn("{task.fields[info]}"))
            self.bar.start()
            self._task = self.bar.add_task("train", total=total, completed=initial, info="")

    def step(self, step: int, metrics: dict[str, float]) -> None:
        record_step(metrics)
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(f"train/{k}", v, step)
            self.tb.flush()
        line = (f"step {step} loss {metrics['loss']:+.4f} reward {metrics['reward_mean']:.3f} "
                f"clip {metrics['clip_frac']:.3f} kl {metrics['approx_kl']:.2e} ent {metrics['entropy']:.3f} "
                f"mismatch {metrics.get('mismatch_k3', 0.0):.1e} (max {metrics.get('mismatch_ratio_max', 1.0):.2f}) "
                f"tok/s {metrics['tokens_per_s']:.0f} stale {metrics['staleness_max']:.0f}")
        if self.bar is not None:
            info = f"loss {metrics['loss']:+.3f} reward {metrics['reward_mean']:.2f}"
            self.bar.update(self._task, advance=1, info=info)
            self.bar.console.print(line, highlight=False, soft_wrap=True)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.bar is not None:
            self.bar.stop()


def health_warnings(rewards: list[float], entropy: float, entropy_floor: float, step: int,
                    reward_drop: float = 0.3) -> list[str]:
    """One-line warnings about the step just taken: the policy's entropy below ``entropy_floor`` (it is
    nearly deterministic: a group's samples all agree, GRPO has nothing to compare, and one update can
    move every answer at once), or the mean reward down by more than ``reward_drop`` within two steps
    (``rewards`` is the run's per-step mean reward so far, this step's last)."""
    out = []
    if entropy_floor > 0 and 0 < entropy < entropy_floor:
        out.append(f"step {step}: policy entropy {entropy:.4f} is below the floor {entropy_floor:g} "
                   "(nearly deterministic; one update can move every answer at once)")
    if len(rewards) >= 2:
        before = max(rewards[-3:-1])
        if before - rewards[-1] > reward_drop:
            out.append(f"step {step}: mean reward fell from {before:.3f} to {rewards[-1]:.3f} within two steps "
                       "(a collapse? see the step's grad_norm and entropy in train.jsonl)")
    return out


def mismatch_warnings(metrics: dict[str, float], warn_kl: float, step: int) -> list[str]:
    """One line when the step's rollout-vs-trainer divergence (k3 KL per trained token) passes ``warn_kl``
    (0: never): the engines sample from a policy other than the one trained (async steps, bf16 or other
    kernels, an engine perturbation); ``correction`` (icepop, seq_mask_geo, tis) keeps such tokens in check."""
    kl = metrics.get("mismatch_k3", 0.0)
    if warn_kl <= 0 or kl <= warn_kl:
        return []
    return [f"step {step}: rollout/trainer mismatch k3 {kl:.2e} > {warn_kl:g} per token (ratio max "
            f"{metrics.get('mismatch_ratio_max', 1.0):.2f}, p99 {metrics.get('mismatch_ratio_p99', 1.0):.3f}); "
            "consider correction: icepop or seq_mask_geo"]
