"""Where the driver's own figures go as a run goes on: each step's reward and zero-signal counts, and each
eval's pass@1 at its policy version, into TensorBoard (``RUN_DIR/tb``, beside the trainer's
``RUN_DIR/trainer/tb``) and, when the experiment turns it on, Weights & Biases.

The x axis is the policy version: a step trains version k + 1 from step k's groups, and the eval of
version v measures the policy after v steps, so the two curves line up. A restarted driver re-reads the
run from Kafka and reports its finished steps again: TensorBoard and W&B (the same run, by its id) keep
both points, with the same values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Tracker:
    def __init__(self, run_dir: Path, run_id: str, wandb: dict[str, Any] | None = None, config: dict | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(run_dir / "tb"))
        self.wandb = None
        if wandb:
            import wandb as wb  # polarstream run checked it is installed
            # the run's id is the W&B run's id, so the same command after a crash continues the same W&B run
            self.wandb = wb.init(project=wandb.get("project", "polarstream"), entity=wandb.get("entity"), id=run_id,
                                 name=run_id, dir=str(run_dir), mode=wandb.get("mode", "offline"), resume="allow",
                                 config=config or {}, settings=wb.Settings(silent=True))
            # the policy version is the x axis: W&B's own step only counts log calls (it may not go back,
            # and a resumed driver reports its finished steps again)
            self.wandb.define_metric("policy_version")
            for prefix in ("driver/*", "eval/*"):
                self.wandb.define_metric(prefix, step_metric="policy_version")

    def _log(self, version: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.tb.add_scalar(key, value, version)
        self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({"policy_version": version, **values})

    def step(self, version: int, reward: float, groups: int, all_correct: int, all_wrong: int, replaced: int,
             mismatch: dict[str, float | None] | None = None) -> None:
        """Step ``version - 1`` trained into ``version``: its reward, groups without signal and the trainer's
        rollout-vs-trainer ``mismatch`` figures (``{name: value}``, None where the trainer gave none)."""
        extra = {f"driver/{k}": v for k, v in (mismatch or {}).items() if v is not None}
        self._log(version, {"driver/reward": reward, "driver/groups": groups, "driver/all_correct": all_correct,
                            "driver/all_wrong": all_wrong, "driver/replaced": replaced, **extra})

    def eval(self, version: int, metrics: dict[str, float]) -> None:
        """The eval split at ``version`` (``pass@1`` and the like)."""
        self._log(version, {f"eval/{k}": v for k, v in metrics.items()})

    def close(self) -> None:
        self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
