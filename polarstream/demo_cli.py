"""`polarstream demo`: the main job, end to end on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(
        steps: Annotated[int, typer.Option(help="GRPO steps (one batch of task groups each)")] = 24,
        tasks_per_step: Annotated[int, typer.Option(help="task groups per step")] = 4,
        samples: Annotated[int, typer.Option(help="samples per task (group size)")] = 8,
        harness: Annotated[str, typer.Option(help="builtin, or a real CLI: qwen_code, pi, claude_code, codex, gemini_cli, opencode")] = "builtin",
        runtime: Annotated[str, typer.Option(help="auto (bwrap when installed), bwrap or subprocess")] = "auto",
        seed: Annotated[int, typer.Option(help="fixes the model, the warm start and the task order")] = 0,
        lr: Annotated[float, typer.Option(help="trainer learning rate")] = 5e-4,
        heldout: Annotated[int, typer.Option(help="problems kept out of RL and evaluated before and after it")] = 16,
        run_dir: Annotated[Optional[Path], typer.Option(help="where logs, the report and demo-summary.json go")] = None,
    ) -> None:
        """Train an agent end to end (Kafka, S3, engine, gateway node, Faust, trainer, rollout) and report."""
        from .demo import DemoConfig, run
        from .processes import ProcessFailed

        cfg = DemoConfig(steps=steps, tasks_per_step=tasks_per_step, samples=samples, harness=harness,
                         runtime=runtime, seed=seed, lr=lr, heldout=heldout)
        if run_dir is not None:
            cfg.run_dir = run_dir
        try:
            path = run(cfg)
        except ProcessFailed as e:
            typer.echo(f"demo failed: {e}", err=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            typer.echo("demo interrupted; every process it started was stopped (infra stays up: polarstream infra down)", err=True)
            raise typer.Exit(130) from None
        typer.echo(path)
