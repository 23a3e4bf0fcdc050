"""``polarstream sft``: supervised fine-tuning on recorded trajectories (torch is imported only when it runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer


def register(app: typer.Typer) -> None:
    """Add ``sft`` to the root command."""
    app.command("sft")(sft_command)


def sft_command(
    model: Annotated[str, typer.Option(help="model to start from: a local HF directory or a built-in name (tiny, "
                                            "tiny:SEED, smollm2)")],
    min_reward: Annotated[Optional[float], typer.Option(help="keep trajectories whose reward is at least this")] = None,
    best_of_group: Annotated[bool, typer.Option("--best-of-group", help="keep only each group's best trajectory "
                                                                         "(ties: the lowest sample index)")] = False,
    task_set: Annotated[Optional[list[str]], typer.Option(help="keep trajectories of this task set; repeat for "
                                                                "several (default: any)")] = None,
    topic_prefix: Annotated[Optional[str], typer.Option(help="read this run's topics (default: the settings' "
                                                             "POLAR_TOPIC_PREFIX)")] = None,
    from_offsets: Annotated[Optional[Path], typer.Option(help='JSON {"trajectories": {"0": 12, ...}}: where a run '
                                                              "without a checkpoint starts (default: the beginning)")] = None,
    follow: Annotated[bool, typer.Option("--follow", help="keep reading new trajectories past the end found at "
                                                          "the start (stops after --idle-timeout)")] = False,
    rows_per_step: Annotated[int, typer.Option(help="trajectories per optimizer step")] = 8,
    max_steps: Annotated[int, typer.Option(help="stop after this many steps in total (0: when the input ends)")] = 0,
    lr: Annotated[float, typer.Option(help="AdamW learning rate")] = 1e-5,
    token_budget: Annotated[int, typer.Option(help="tokens per packed micro-batch")] = 4096,
    checkpoint_every: Annotated[int, typer.Option(help="steps between checkpoints")] = 1,
    idle_timeout: Annotated[float, typer.Option(help="with --follow: stop after this many seconds without a row")] = 0.0,
    checkpoint_url: Annotated[str, typer.Option(help="checkpoint root (file:// or s3://); default: "
                                                     "<storage>/sft")] = "",
    run_dir: Annotated[str, typer.Option(help="JSONL log directory (default: <data_dir>/sft)")] = "",
    strategy: Annotated[str, typer.Option(help="auto: FSDP2 under torchrun with several processes; fsdp: FSDP2 in "
                                               "one process too")] = "auto",
    config: Annotated[str, typer.Option(help="YAML settings file (infra settings, see infra/settings.py)")] = "",
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="any trainer setting as key=value "
                                                                     "(trainer/config.py; e.g. lora_rank=16)")] = None,
) -> None:
    """Train on recorded trajectories (any run's) that pass a rule; checkpoints carry the read positions."""
    from infra.settings import Settings
    from producers.positions import PositionError, load_offsets

    from .config import ConfigError
    from .sft import SftSpec, sft_config
    from .sft_select import Rule

    overrides: dict[str, object] = {
        "model": model, "max_steps": max_steps, "lr": lr, "token_budget": token_budget,
        "checkpoint_every": checkpoint_every, "idle_timeout_s": idle_timeout, "run_dir": run_dir, "strategy": strategy,
    }
    for item in set_ or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"{item!r}: expected key=value", param_hint="--set")
        overrides[key.strip().replace("-", "_")] = value
    if rows_per_step < 1:
        raise typer.BadParameter(f"{rows_per_step}: must be >= 1", param_hint="--rows-per-step")
    if follow and not idle_timeout:
        raise typer.BadParameter("--follow needs --idle-timeout (else the run never ends)", param_hint="--follow")
    try:
        cfg = sft_config(overrides)
        cfg.resolve_model_dir()
    except ConfigError as e:
        raise typer.BadParameter(str(e)) from None
    settings = Settings(**({"config": config} if config else {}))
    read = settings.model_copy(update={"topic_prefix": topic_prefix}) if topic_prefix is not None else settings
    try:
        start = load_offsets(from_offsets, ("trajectories",)).get("trajectories", {}) if from_offsets else None
    except PositionError as e:
        raise typer.BadParameter(str(e), param_hint="--from-offsets") from None
    spec = SftSpec(rule=Rule(min_reward, best_of_group, tuple(task_set or ())), rows_per_step=rows_per_step,
                   read=read, start=start, follow=follow, checkpoint_url=checkpoint_url)

    from infra.reach import require_kafka, require_storage

    require_storage(settings, spec.checkpoint_url or settings.checkpoint_url, wait_s=settings.wait_for_s)
    require_kafka(settings, wait_s=settings.wait_for_s)

    from confluent_kafka import KafkaException

    from .checkpoint import CheckpointError
    from .sft import sft

    try:
        summary = sft(cfg, settings, spec)
    except ConfigError as e:
        raise typer.BadParameter(str(e)) from None
    except (KafkaException, CheckpointError) as e:  # unreachable broker, missing topic, unreadable storage
        typer.echo(f"polarstream sft: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(summary, sort_keys=True))
