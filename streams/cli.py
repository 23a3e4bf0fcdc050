"""``polarstream streams ...``: run stream-processor workers (Faust is imported only when one starts)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

streams_app = typer.Typer(no_args_is_help=True, help="Stream processors: calls -> trajectories -> groups.")


@streams_app.command()
def worker(
    builder: str = typer.Option("prefix_merging", help="per_request | prefix_merging"),
    advantage: str = typer.Option("grpo", help="grpo (mean/std) | loo (leave-one-out/std) | no_std (mean only)"),
    side_calls: str = typer.Option("trace", help="trace: own traces | drop: left out"),
    zero_variance: str = typer.Option("keep", help="keep (flagged) | drop"),
    epsilon: float = typer.Option(1e-6, help="added to the group std"),
    timeout_reward: float = typer.Option(0.0, help="reward of agent-budget timeouts (they stay trainable)"),
    overlong_max_tokens: int = typer.Option(0, help="DAPO's soft overlong punishment: sampled-token budget (0: off)"),
    overlong_buffer: int = typer.Option(0, help="... the last this many tokens of it lose reward linearly"),
    overlong_penalty: float = typer.Option(1.0, help="... down to -this at the budget and beyond"),
    group_deadline: float = typer.Option(600.0, help="seconds after a group's first trajectory to emit with >= min_valid"),
    missing_calls_grace: float = typer.Option(30.0, help="seconds a finished session waits for missing calls (also in the calls topic)"),
    missing_calls_timeout: float = typer.Option(300.0, help="seconds after which it stops waiting regardless"),
    tick_interval: float = typer.Option(2.0, help="seconds between deadline sweeps"),
    session_timeout: float = typer.Option(10.0, help="consumer session timeout (s): how fast a dead worker is noticed"),
    stats_interval: float = typer.Option(10.0, help="seconds between counter snapshots (and lag gauge updates)"),
    metrics_port: int = typer.Option(0, help="serve Prometheus /metrics on this port (0: off; docs/operations.md)"),
    loglevel: str = typer.Option("info"),
    config: Optional[Path] = typer.Option(None, help="settings YAML (else POLAR_* environment)"),
    judge: Optional[Path] = typer.Option(None, help="judge YAML (streams/judge.py JudgeConfig; docs/rewards.md): "
                                         "score trajectories before the advantages; endpoint, model and key default "
                                         "to the settings' judge_*"),
) -> None:
    """Run one worker; start several (same POLAR_TOPIC_PREFIX) to split the partitions."""
    from pydantic import ValidationError

    from infra.heap import freeze_startup_heap
    from infra.reach import require_kafka
    from infra.settings import Settings

    from .config import StreamsConfig
    from .topology import TopologyError

    settings = Settings(config=str(config)) if config else Settings()
    try:
        judge_cfg = load_judge(judge, settings) if judge else None
        cfg = StreamsConfig(
            builder=builder, advantage=advantage, side_calls=side_calls, zero_variance=zero_variance,
            epsilon=epsilon, timeout_reward=timeout_reward, group_deadline_s=group_deadline,
            overlong_max_tokens=overlong_max_tokens, overlong_buffer=overlong_buffer, overlong_penalty=overlong_penalty,
            missing_calls_grace_s=missing_calls_grace, missing_calls_timeout_s=missing_calls_timeout,
            tick_interval_s=tick_interval, judge=judge_cfg,
        )
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = f"{err['loc'][0]}: " if err["loc"] else ""
        raise typer.BadParameter(f"{where}{err['msg'].removeprefix('Value error, ')}") from None
    require_kafka(settings, wait_s=settings.wait_for_s)  # before Faust, which would retry a dead broker and log every attempt
    if metrics_port:
        from infra.metrics import serve

        serve(metrics_port)  # a port in use ends here, in one line (polarstream/errors.py)

    from faust.worker import Worker

    from .app import create_app

    try:
        app = create_app(settings, cfg, session_timeout_s=session_timeout, stats_interval_s=stats_interval)
    except TopologyError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    freeze_startup_heap()  # see infra/heap.py
    Worker(app, loglevel=loglevel, quiet=True).execute_from_commandline()


def load_judge(path: Path, settings) -> "JudgeConfig":  # noqa: F821 - imported inside
    """A judge's YAML, its endpoint, model and key from the settings where it names none."""
    import yaml

    from .judge import JudgeConfig

    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise typer.BadParameter(f"--judge {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise typer.BadParameter(f"--judge {path}: not YAML ({getattr(e, 'problem', None) or 'malformed'}{where})") from None
    if not isinstance(doc, dict):
        raise typer.BadParameter(f"--judge {path}: expected a mapping of JudgeConfig fields")
    defaults = {"base_url": settings.judge_base_url, "model": settings.judge_model,
                "api_key": settings.judge_api_key.get_secret_value()}
    return JudgeConfig(**{**{k: v for k, v in defaults.items() if v}, **doc})


def register(app: typer.Typer) -> None:
    """Add ``streams`` to the root command."""
    app.add_typer(streams_app, name="streams")
