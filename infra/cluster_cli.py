"""The multi-DC parts of ``polarstream infra``: ``--cluster NAME`` on up/down/status/topics, and ``mirror``.

Kept apart from infra/cli.py so that file stays about the default stack; cli.py hands over to these
functions when ``--cluster`` is given and registers ``mirror`` from here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

CLUSTER = typer.Option(None, "--cluster", help="a named local cluster (own ports and data dir): docs/multi-dc.md")


def base_settings(config: Optional[Path]):
    """Settings from --config or the environment."""
    from .settings import Settings

    return Settings(config=str(config)) if config else Settings()


def _fail(e: Exception) -> None:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(1)


def _cluster(config: Optional[Path], name: str, create: bool = False, secure: bool = False, heap_mb: int = 512):
    from .clusters import Cluster
    from .errors import InfraError

    try:
        base = base_settings(config)
        return Cluster(base, name, create=create, secure=secure or base.secure, heap_mb=heap_mb)
    except InfraError as e:
        _fail(e)


def cluster_up(config: Optional[Path], name: str, timeout: float, secure: bool = False, heap_mb: int = 512) -> None:
    """`infra up --cluster NAME [--secure]`: its broker (ports chosen once, remembered) and its topics.

    Secured (remembered in cluster.json): its own CA and users under clusters/NAME/security/, ACLs applied."""
    from .errors import InfraError

    cluster = _cluster(config, name, create=True, secure=secure, heap_mb=heap_mb)
    try:
        report = cluster.up(timeout)
    except InfraError as e:
        _fail(e)
    k = cluster.status()["kafka"]
    typer.echo(f"kafka   up  {k['bootstrap']}  pid {k['pid']}  cluster {name}  data {k['data_dir']}")
    if cluster.settings.secure:
        typer.echo(f"secure  SASL_SSL (SCRAM-SHA-512) + ACLs; CA, credentials: {cluster.settings.data_dir}/security/")
    for line in report.lines():
        typer.echo(f"topic   {line}")


def cluster_down(config: Optional[Path], name: str) -> None:
    """`infra down --cluster NAME`."""
    for what, was_running in _cluster(config, name).down().items():
        typer.echo(f"{what:7} {'stopped' if was_running else 'was not running'}")


def cluster_status(config: Optional[Path], name: str, as_json: bool) -> None:
    """`infra status --cluster NAME`."""
    st = _cluster(config, name).status()
    if as_json:
        typer.echo(json.dumps(st, indent=2))
        return
    k = st["kafka"]
    typer.echo(f"kafka   {'up  ' if k['up'] else 'down'}  {k['bootstrap']}  pid {k['pid']}  cluster {name}  "
               f"{'secure  ' if st['secure'] else ''}data {k['data_dir']}")


def cluster_topics(config: Optional[Path], name: str):
    """Settings of cluster NAME (its admin when secured), for `infra topics|acls --cluster NAME`."""
    return _cluster(config, name).settings


def multidc_status(base, window_s: float) -> dict:
    """Named clusters and mirror flows (lag, events/s) for `infra status` of the default settings."""
    from .clusters import Cluster
    from .discovery import cluster_names
    from .mirror import flows_metrics, flows_of, known_mirrors, parse_properties

    handles = {n: Cluster(base, n) for n in cluster_names(base.data_dir)}
    clusters = {n: c.status()["kafka"] for n, c in handles.items()}
    # Each local cluster is reached with its own credentials (a secured one: its admin, its CA).
    clients = {n: c.settings.kafka_auth() | c.settings.kafka_security for n, c in handles.items()}
    mirrors = [(mm, flows_of(parse_properties(mm.config_file.read_text()))) for mm in known_mirrors(base)]
    metrics = iter(flows_metrics([f for _, flows in mirrors for f in flows], base.kafka_auth() | base.kafka_security,
                                 window_s, clients) if mirrors else [])
    return {"clusters": clusters,
            "mirrors": [{**mm.status(), "flows": [next(metrics) for _ in flows]} for mm, flows in mirrors]}


def status_lines(st: dict) -> list[str]:
    """Text lines for the clusters and mirrors part of `infra status`."""
    lines = []
    for name, k in st.get("clusters", {}).items():
        lines.append(f"cluster {name:10} {'up  ' if k['up'] else 'down'}  {k['bootstrap']}  pid {k['pid']}"
                     + ("  secure" if k.get("secure") else ""))
    for m in st.get("mirrors", []):
        lines.append(f"mirror  {m['name']:10} {'running' if m['running'] else 'stopped'}  pid {m['pid']}  {m['config']}")
        for f in m["flows"]:
            if "error" in f:
                lines.append(f"        {f['source']} -> {f['target']}  unavailable: {f['error']}")
            else:
                lines.append(f"        {f['source']} -> {f['target']}  lag {f['lag']}  {f['events_per_s']} events/s")
    return lines


def _bootstrap(base, name: str, placeholder: bool) -> str:
    """A local cluster's bootstrap; with ``placeholder`` an unknown one gets a line to edit instead."""
    from .clusters import cluster_settings
    from .discovery import read_cluster_state

    if placeholder and read_cluster_state(base.data_dir, name) is None:
        return f"{name.upper()}-BOOTSTRAP-SERVERS:9092"
    return cluster_settings(base, name).kafka_bootstrap


def _link_clients(base, names) -> dict:
    """MM2's client settings per secured local cluster (it runs as that cluster's admin)."""
    from .clusters import cluster_admin
    from .discovery import read_cluster_state

    return {n: cluster_admin(base, n) for n in names if (read_cluster_state(base.data_dir, n) or {}).get("secure")}


def mirror(
    config: Optional[Path] = typer.Option(None, "--config", help="YAML settings file (else POLAR_* env vars and defaults)"),
    source: str = typer.Option(..., "--from", help="the regional cluster (collects calls)"),
    target: str = typer.Option(..., "--to", help="the central cluster (trains)"),
    print_config: bool = typer.Option(False, "--print-config", help="print the MM2 properties file and start nothing"),
    stop: bool = typer.Option(False, "--stop", help="stop this pair's MirrorMaker"),
    refresh: int = typer.Option(10, help="seconds between MM2's topic/group refreshes and checkpoints"),
    timeout: float = typer.Option(120.0, help="seconds to wait for MirrorMaker to start"),
    heap_mb: int = typer.Option(256, "--heap-mb", help="MirrorMaker's JVM heap (MB)"),
) -> None:
    """Run MirrorMaker 2 between a region and the center: calls + session events up, tasks + policy down."""
    from .discovery import check_name
    from .errors import InfraError
    from .maven import fetch
    from .mirror import MirrorMaker, externalize_secrets, mirror_properties, mirrors_dir
    from .process import tcp_open

    base = base_settings(config)
    try:
        check_name(source), check_name(target)
        if source == target:
            raise InfraError(f"--from and --to are both {source!r}: a cluster does not mirror to itself")
        if stop:
            stopped = MirrorMaker(base, region=source, center=target).stop()
            typer.echo(f"mirror  {source}-{target} {'stopped' if stopped else 'was not running'}")
            return
        bootstrap = {n: _bootstrap(base, n, placeholder=print_config) for n in (source, target)}
        props = mirror_properties(source, bootstrap[source], target, bootstrap[target], base, refresh_s=refresh,
                                  clients=_link_clients(base, (source, target)))
        mm = MirrorMaker(base, region=source, center=target, heap_mb=heap_mb)
        # Passwords of secured links go to a 0600 file beside it, read through ${file:...} references.
        mm.props, mm.secrets = externalize_secrets(props, mm.secrets_file)
        if print_config:
            mirrors_dir(base).mkdir(parents=True, exist_ok=True)
            mm.prepare()
            typer.echo(mm.config_file.read_text(), nl=False)
            return
        for name in (source, target):
            port = int(bootstrap[name].rsplit(":", 1)[1])
            if not tcp_open(port):
                raise InfraError(f"cluster {name!r} is not running: `polarstream infra up --cluster {name}` first")
        fetch("mirror", base)
        started = mm.start(timeout)
    except InfraError as e:
        _fail(e)
    typer.echo(f"mirror  {source}-{target} {'started' if started else 'already running'}  pid {mm.pid()}  "
               f"config {mm.config_file}  log {mm.log_file}")
