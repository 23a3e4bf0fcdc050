"""``polarstream train``: the trainer's command (torch is imported only when it runs)."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer


def register(app: typer.Typer) -> None:
    """Add ``train`` to the root command."""
    app.command("train")(train_command)


def train_command(
    model: Annotated[str, typer.Option(help="model to start from: a local HF directory (config.json, weights, "
                                            "tokenizer) or a built-in name (tiny, tiny:SEED, smollm2)")],
    groups_per_step: Annotated[int, typer.Option(help="groups per optimizer step")] = 4,
    max_steps: Annotated[int, typer.Option(help="stop after this many steps in total (0: no limit)")] = 0,
    lr: Annotated[float, typer.Option(help="AdamW learning rate")] = 1e-5,
    token_budget: Annotated[int, typer.Option(help="tokens per packed micro-batch")] = 4096,
    checkpoint_every: Annotated[int, typer.Option(help="steps between checkpoints")] = 1,
    sync_every: Annotated[int, typer.Option(help="steps between weight pushes to engines (0: never)")] = 1,
    engine: Annotated[Optional[list[str]], typer.Option(help="polar=URL or vllm=URL; repeat for several")] = None,
    gateway: Annotated[str, typer.Option(help="gateway URL whose policy version is stamped after a sync")] = "",
    idle_timeout: Annotated[float, typer.Option(help="stop after this many seconds without a group (0: never)")] = 0.0,
    storage_url: Annotated[str, typer.Option(help="checkpoint root (file:// or s3://); default: settings")] = "",
    run_dir: Annotated[str, typer.Option(help="JSONL log and TensorBoard directory")] = "",
    metrics_port: Annotated[int, typer.Option(help="serve Prometheus /metrics on this port (0: off; docs/operations.md)")] = 0,
    weight_transfer: Annotated[str, typer.Option(help="storage: engines load the checkpoint URL; broadcast: "
                                                      "in memory (vLLM's weight-transfer routes); auto: broadcast "
                                                      "where GET /weight_info answers, else storage")] = "auto",
    strategy: Annotated[str, typer.Option(help="auto: FSDP2 under torchrun with several processes, else one plain "
                                               "model; fsdp: FSDP2 in one process too")] = "auto",
    config: Annotated[str, typer.Option(help="YAML settings file (infra settings, see infra/settings.py)")] = "",
    set_: Annotated[
        Optional[list[str]], typer.Option("--set", help="any trainer setting as key=value (trainer/config.py)")
    ] = None,
) -> None:
    """Train on polar.groups with GRPO; checkpoints carry the consumed offsets, so restarts are exact."""
    from infra.settings import Settings

    from .config import ConfigError, TrainConfig

    overrides: dict[str, object] = {
        "model": model, "groups_per_step": groups_per_step, "max_steps": max_steps, "lr": lr,
        "token_budget": token_budget, "checkpoint_every": checkpoint_every, "sync_every": sync_every,
        "engines": engine or [], "gateway": gateway, "idle_timeout_s": idle_timeout, "run_dir": run_dir,
        "metrics_port": metrics_port, "strategy": strategy, "weight_transfer": weight_transfer,
    }
    for item in set_ or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"{item!r}: expected key=value", param_hint="--set")
        overrides[key.strip().replace("-", "_")] = value
    try:
        cfg = TrainConfig.from_overrides(overrides)
        cfg.resolve_model_dir()  # before the services are probed: the model is what the user typed
    except ConfigError as e:
        raise typer.BadParameter(str(e)) from None
    kwargs = {"config": config} if config else {}
    if storage_url:
        kwargs["storage_url"] = storage_url
    settings = Settings(**kwargs)
    _require_services(cfg, settings)

    from confluent_kafka import KafkaException

    from .checkpoint import CheckpointError
    from .train import train
    from .sync.storage import WeightSyncError

    try:
        summary = train(cfg, settings)
    except ConfigError as e:
        raise typer.BadParameter(str(e)) from None
    # unreachable broker, missing topic, unreadable storage, engines that keep refusing new weights
    except (KafkaException, CheckpointError, WeightSyncError) as e:
        typer.echo(f"polarstream train: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(summary, sort_keys=True))


def _require_services(cfg, settings) -> None:
    """Fail in one line, before torch loads, when an engine, the gateway, S3 or Kafka does not answer."""
    from infra.reach import ENGINE_HINT, require_free_port, require_kafka, require_storage, require_url

    import os

    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 alone serves /metrics; another rank would find it taken
        require_free_port(cfg.metrics_port)  # 0: off
    for spec in cfg.engines:
        require_url(spec.partition("=")[2], "the engine", ENGINE_HINT, wait_s=settings.wait_for_s)
    if cfg.gateway:
        require_url(cfg.gateway, "the gateway", "is it running? `polarstream gateway` or `polarstream node` starts one",
                    wait_s=settings.wait_for_s)
    require_storage(settings, settings.checkpoint_url, wait_s=settings.wait_for_s)
    require_kafka(settings, wait_s=settings.wait_for_s)


def main() -> None:
    """Entry point for ``python -m trainer`` / torchrun (trainer/__main__.py): the same options as ``polarstream train``."""
    typer.run(train_command)
