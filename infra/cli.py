"""``polarstream infra up | down | status | topics | fetch | mirror``: the local Kafka broker and S3 server.

Ports, data directory and topic prefix come from Settings (POLAR_KAFKA_PORT, POLAR_S3_PORT,
POLAR_DATA_DIR, POLAR_TOPIC_PREFIX, ... or --config FILE), so a second instance runs beside the first.
``--cluster NAME`` and ``mirror`` (multi-DC, docs/multi-dc.md) live in infra/cluster_cli.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from .cluster_cli import CLUSTER, cluster_down, cluster_status, cluster_topics, cluster_up, mirror, multidc_status, status_lines

infra_app = typer.Typer(no_args_is_help=True, add_completion=False,
                        help="The local Kafka broker and S3 server (from Maven Central), and the topics.")

_CONFIG = typer.Option(None, "--config", help="YAML settings file (else POLAR_* env vars and defaults)")


def _stack(config: Optional[Path], secure: bool = False):
    from .settings import Settings
    from .stack import Stack

    kw = {"secure": True} if secure else {}  # --secure wins over POLAR_SECURE / the config file
    return Stack(Settings(config=str(config), **kw) if config else Settings(**kw))


_SECURE = typer.Option(False, "--secure", help="SASL_SSL + ACLs + read-only S3 (docs/security.md); also POLAR_SECURE=1")


def _fail(e: Exception) -> None:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(1)


@infra_app.command()
def up(config: Optional[Path] = _CONFIG, timeout: float = typer.Option(120.0, help="seconds to wait for each server"),
       secure: bool = _SECURE, cluster: Optional[str] = CLUSTER,
       heap_mb: int = typer.Option(512, "--heap-mb", help="the named cluster's broker heap (MB), with --cluster")) -> None:
    """Start Kafka and S3 unless they run, create the default bucket, apply infra/topics.yaml."""
    from .errors import InfraError

    if cluster:
        return cluster_up(config, cluster, timeout, secure, heap_mb)

    stack = _stack(config, secure)
    try:
        report = stack.up(timeout)
    except InfraError as e:
        _fail(e)
    st = stack.status()
    typer.echo(f"kafka   up  {st['kafka']['bootstrap']}  pid {st['kafka']['pid']}  data {st['kafka']['data_dir']}")
    typer.echo(f"storage up  {st['storage']['endpoint']}  pid {st['storage']['pid']}  bucket {st['storage']['bucket']}")
    if st.get("storage_read"):
        r = st["storage_read"]
        typer.echo(f"storage up  {r['endpoint']}  pid {r['pid']}  read-only (checkpoint readers)")
    if st.get("secure"):
        typer.echo(f"secure  SASL_SSL (SCRAM-SHA-512) + ACLs; CA, credentials: {st['data_dir']}/security/")
    for line in report.lines():
        typer.echo(f"topic   {line}")


@infra_app.command()
def down(config: Optional[Path] = _CONFIG, secure: bool = _SECURE, cluster: Optional[str] = CLUSTER) -> None:
    """Stop exactly the servers `up` started for these settings (found through their pid files)."""
    if cluster:
        return cluster_down(config, cluster)
    stopped = _stack(config, secure).down()
    for name, was_running in stopped.items():
        typer.echo(f"{name:7} {'stopped' if was_running else 'was not running'}")


@infra_app.command()
def status(config: Optional[Path] = _CONFIG, as_json: bool = typer.Option(False, "--json", help="machine-readable"),
           secure: bool = _SECURE, cluster: Optional[str] = CLUSTER,
           window: float = typer.Option(2.0, help="seconds over which mirror throughput is measured")) -> None:
    """Whether Kafka and S3 are up, with ports, pids and data directories; named clusters and mirror lag."""
    if cluster:
        return cluster_status(config, cluster, as_json)
    stack = _stack(config, secure)
    st = {**stack.status(), **multidc_status(stack.settings, window)}
    if as_json:
        typer.echo(json.dumps(st, indent=2))
        return
    k, s = st["kafka"], st["storage"]
    typer.echo(f"kafka   {'up  ' if k['up'] else 'down'}  {k['bootstrap']}  pid {k['pid']}  data {k['data_dir']}")
    typer.echo(f"storage {'up  ' if s['up'] else 'down'}  {s['endpoint']}  pid {s['pid']}  data {s['data_dir']}")
    for line in status_lines(st):
        typer.echo(line)


@infra_app.command()
def topics(config: Optional[Path] = _CONFIG, as_json: bool = typer.Option(False, "--json", help="machine-readable"),
           cluster: Optional[str] = CLUSTER) -> None:
    """Apply infra/topics.yaml: create missing topics, align configs, report drift (exit 2 on drift)."""
    from .errors import InfraError
    from .reach import require_kafka
    from .topics import ensure_topics

    try:
        settings = cluster_topics(config, cluster) if cluster else _stack(config).settings
        require_kafka(settings)
        report = ensure_topics(settings)
    except InfraError as e:
        _fail(e)
    typer.echo(json.dumps(report.to_dict(), indent=2) if as_json else "\n".join(report.lines()))
    if not report.ok:
        raise typer.Exit(2)


@infra_app.command()
def acls(config: Optional[Path] = _CONFIG, show: bool = typer.Option(False, "--print", help="list the bindings, apply nothing"),
         cluster: Optional[str] = CLUSTER) -> None:
    """Apply infra/acls.yaml (per-component ACLs for this topic prefix) as the configured admin principal."""
    from .acls import acl_bindings, apply_acls
    from .errors import InfraError
    from .reach import require_kafka
    from .settings import Settings

    settings = cluster_topics(config, cluster) if cluster else (Settings(config=str(config)) if config else Settings())
    if cluster and not settings.secure and not show:
        _fail(InfraError(f"cluster {cluster!r} is not secured (no authorizer): `polarstream infra up --cluster "
                         f"{cluster} --secure` creates a secured one"))
    if show:
        for b in acl_bindings(settings):
            typer.echo(f"{b.principal:16} {b.operation.name:16} {b.restype.name.lower():6} {b.resource_pattern_type.name.lower():8} {b.name}")
        return
    try:
        require_kafka(settings)
        typer.echo(f"applied {apply_acls(settings)} ACL bindings for prefix {settings.topic_prefix!r}")
    except InfraError as e:
        _fail(e)


@infra_app.command()
def fetch(config: Optional[Path] = _CONFIG) -> None:
    """Resolve the Kafka and s3proxy jars from Maven Central into the cache (up does this on demand)."""
    from .errors import InfraError
    from .maven import fetch as fetch_jars

    settings = _stack(config).settings
    try:
        for profile in ("kafka", "s3proxy", "mirror"):
            typer.echo(f"{profile:8} {fetch_jars(profile, settings)}")
    except InfraError as e:
        _fail(e)


infra_app.command("mirror")(mirror)


def register(app: typer.Typer) -> None:
    """Add ``polarstream infra ...`` to the root command."""
    app.add_typer(infra_app, name="infra")
