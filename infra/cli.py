"""``polarstream infra up | down | status | topics | fetch``: the local Kafka broker and S3 server.

Ports, data directory and topic prefix come from Settings (POLAR_KAFKA_PORT, POLAR_S3_PORT,
POLAR_DATA_DIR, POLAR_TOPIC_PREFIX, ... or --config FILE), so a second instance runs beside the first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

infra_app = typer.Typer(no_args_is_help=True, add_completion=False,
                        help="The local Kafka broker and S3 server (from Maven Central), and the topics.")

_CONFIG = typer.Option(None, "--config", help="YAML settings file (else POLAR_* env vars and defaults)")


def _stack(config: Optional[Path]):
    from .settings import Settings
    from .stack import Stack

    return Stack(Settings(config=str(config)) if config else Settings())


def _fail(e: Exception) -> None:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(1)


@infra_app.command()
def up(config: Optional[Path] = _CONFIG, timeout: float = typer.Option(120.0, help="seconds to wait for each server")) -> None:
    """Start Kafka and S3 unless they run, create the default bucket, apply infra/topics.yaml."""
    from .errors import InfraError

    stack = _stack(config)
    try:
        report = stack.up(timeout)
    except InfraError as e:
        _fail(e)
    st = stack.status()
    typer.echo(f"kafka   up  {st['kafka']['bootstrap']}  pid {st['kafka']['pid']}  data {st['kafka']['data_dir']}")
    typer.echo(f"storage up  {st['storage']['endpoint']}  pid {st['storage']['pid']}  bucket {st['storage']['bucket']}")
    for line in report.lines():
        typer.echo(f"topic   {line}")


@infra_app.command()
def down(config: Optional[Path] = _CONFIG) -> None:
    """Stop exactly the servers `up` started for these settings (found through their pid files)."""
    stopped = _stack(config).down()
    for name, was_running in stopped.items():
        typer.echo(f"{name:7} {'stopped' if was_running else 'was not running'}")


@infra_app.command()
def status(config: Optional[Path] = _CONFIG, as_json: bool = typer.Option(False, "--json", help="machine-readable")) -> None:
    """Whether Kafka and S3 are up, with ports, pids and data directories."""
    st = _stack(config).status()
    if as_json:
        typer.echo(json.dumps(st, indent=2))
        return
    k, s = st["kafka"], st["storage"]
    typer.echo(f"kafka   {'up  ' if k['up'] else 'down'}  {k['bootstrap']}  pid {k['pid']}  data {k['data_dir']}")
    typer.echo(f"storage {'up  ' if s['up'] else 'down'}  {s['endpoint']}  pid {s['pid']}  data {s['data_dir']}")


@infra_app.command()
def topics(config: Optional[Path] = _CONFIG, as_json: bool = typer.Option(False, "--json", help="machine-readable")) -> None:
    """Apply infra/topics.yaml: create missing topics, align configs, report drift (exit 2 on drift)."""
    from .errors import InfraError
    from .topics import ensure_topics

    try:
        report = ensure_topics(_stack(config).settings)
    except InfraError as e:
        _fail(e)
    typer.echo(json.dumps(report.to_dict(), indent=2) if as_json else "\n".join(report.lines()))
    if not report.ok:
        raise typer.Exit(2)


@infra_app.command()
def fetch(config: Optional[Path] = _CONFIG) -> None:
    """Resolve the Kafka and s3proxy jars from Maven Central into the cache (up does this on demand)."""
    from .errors import InfraError
    from .maven import fetch as fetch_jars

    settings = _stack(config).settings
    try:
        for profile in ("kafka", "s3proxy"):
            typer.echo(f"{profile:8} {fetch_jars(profile, settings)}")
    except InfraError as e:
        _fail(e)


def register(app: typer.Typer) -> None:
    """Add ``polarstream infra ...`` to the root command."""
    app.add_typer(infra_app, name="infra")
