"""``polarstream infra up | down | status | topics | fetch | mirror | broker``: the local Kafka and S3 server.

``up --brokers 3`` runs a replicated local cluster (infra/kafka_cluster.py); the data directory remembers
it, so down, status and every component find all its brokers, and ``broker N kill|start|restart``
crashes or revives one of them.

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


def _stack(config: Optional[Path], secure: bool = False, brokers: Optional[int] = None, heap_mb: Optional[int] = None):
    from .settings import Settings
    from .stack import Stack

    kw = {"secure": True} if secure else {}  # --secure wins over POLAR_SECURE / the config file
    return Stack(Settings(config=str(config), **kw) if config else Settings(**kw), brokers=brokers, heap_mb=heap_mb)


_SECURE = typer.Option(False, "--secure", help="SASL_SSL + ACLs + read-only S3 (docs/security.md); also POLAR_SECURE=1")


def _fail(e: Exception) -> None:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(1)


@infra_app.command()
def up(config: Optional[Path] = _CONFIG, timeout: float = typer.Option(120.0, help="seconds to wait for each server"),
       secure: bool = _SECURE, cluster: Optional[str] = CLUSTER,
       heap_mb: int = typer.Option(512, "--heap-mb", help="each broker's heap (MB), with --cluster or --brokers"),
       brokers: Optional[int] = typer.Option(None, "--brokers", min=1, max=9,
                                             help="Kafka nodes: 3 = a replicated cluster (RF 3, min ISR 2), "
                                                  "remembered by the data dir; default 1 (or what it remembers)")) -> None:
    """Start Kafka and S3 unless they run, create the default bucket, apply infra/topics.yaml."""
    from .errors import InfraError

    if cluster:
        if brokers not in (None, 1):
            _fail(InfraError("--brokers with --cluster is not supported: a named cluster is one broker"))
        return cluster_up(config, cluster, timeout, secure, heap_mb)

    try:
        stack = _stack(config, secure, brokers, heap_mb)  # the heap applies to a cluster's nodes only
        report = stack.up(timeout)
    except InfraError as e:
        _fail(e)
    st = stack.status()
    typer.echo(f"kafka   up  {st['kafka']['bootstrap']}  pid {st['kafka']['pid']}  data {st['kafka']['data_dir']}")
    for line in _node_lines(st["kafka"]):
        typer.echo(line)
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
    from .errors import InfraError

    if cluster:
        return cluster_down(config, cluster)
    try:
        stopped = _stack(config, secure).down()
    except InfraError as e:
        _fail(e)
    for name, was_running in stopped.items():
        typer.echo(f"{name:7} {'stopped' if was_running else 'was not running'}")


@infra_app.command()
def status(config: Optional[Path] = _CONFIG, as_json: bool = typer.Option(False, "--json", help="machine-readable"),
           secure: bool = _SECURE, cluster: Optional[str] = CLUSTER,
           window: float = typer.Option(2.0, help="seconds over which mirror throughput is measured")) -> None:
    """Whether Kafka and S3 are up, with ports, pids and data directories; named clusters and mirror lag."""
    from .errors import InfraError

    if cluster:
        return cluster_status(config, cluster, as_json)
    try:
        stack = _stack(config, secure)
    except InfraError as e:
        _fail(e)
    st = {**stack.status(), **multidc_status(stack.settings, window)}
    if as_json:
        typer.echo(json.dumps(st, indent=2))
        return
    k, s = st["kafka"], st["storage"]
    typer.echo(f"kafka   {'up  ' if k['up'] else 'down'}  {k['bootstrap']}  pid {k['pid']}  data {k['data_dir']}")
    for line in _node_lines(k):
        typer.echo(line)
    typer.echo(f"storage {'up  ' if s['up'] else 'down'}  {s['endpoint']}  pid {s['pid']}  data {s['data_dir']}")
    for line in status_lines(st):
        typer.echo(line)


def _node_lines(kafka: dict) -> list[str]:
    """One line per node of a replicated cluster (none for the single broker)."""
    if "nodes" not in kafka:
        return []
    head = (f"        {kafka['brokers_up']}/{kafka['brokers']} brokers up; topics: replication factor "
            f"{kafka['replication_factor']}, min.insync.replicas {kafka['min_insync_replicas']}")
    return [head] + [f"broker {i} {'up  ' if n['up'] else 'down'}  {n['bootstrap']}  controller :{n['controller_port']}  "
                     f"node.id {n['node_id']}  pid {n['pid']}  log {n['log']}" for i, n in enumerate(kafka["nodes"])]


@infra_app.command()
def broker(index: int = typer.Argument(..., help="the broker's index, 0-based (see `infra status`)"),
           action: str = typer.Argument(..., help="kill (SIGKILL, as a crash) | start | restart (kill, then start)"),
           config: Optional[Path] = _CONFIG, timeout: float = typer.Option(120.0, help="seconds to wait for a start")) -> None:
    """Crash or revive one broker of the replicated local cluster (`up --brokers 3`): chaos by hand."""
    from .errors import InfraError
    from .kafka_cluster import KafkaCluster

    try:
        stack = _stack(config)
        if action not in ("kill", "start", "restart"):  # a typo is named before the cluster is looked at
            raise InfraError(f"unknown action {action!r}: expected kill, start or restart")
        if not isinstance(stack.kafka, KafkaCluster):
            raise InfraError("the local Kafka is a single broker: `broker` needs `polarstream infra up --brokers 3`")
        if not 0 <= index < stack.kafka.brokers:
            raise InfraError(f"no broker {index}: this cluster has brokers 0 to {stack.kafka.brokers - 1}")
        if action == "kill":
            typer.echo(f"broker {index} killed (pid {stack.kafka.kill(index)})")
        elif action == "start":
            stack.kafka.revive(index, timeout)
            typer.echo(f"broker {index} up  {stack.kafka.nodes[index].bootstrap}  pid {stack.kafka.nodes[index].pid()}")
        elif action == "restart":
            took = stack.kafka.kill_and_restart(index, timeout=timeout)
            typer.echo(f"broker {index} killed and serving again after {took:.1f} s")
    except InfraError as e:
        _fail(e)


@infra_app.command()
def serve(server: str = typer.Argument(..., help="kafka (one node of a cluster) | s3"),
          node_id: int = typer.Option(1, help="kafka: this node's id, 1-based"),
          voters: str = typer.Option("", help="kafka: the cluster's controllers, id@host:port,... (the same on every node)"),
          cluster_id: str = typer.Option("", help="kafka: the cluster's id (the same on every node; `infra serve` formats "
                                                  "the node's storage with it on its first start)"),
          advertise: str = typer.Option("", help="kafka: the host name the others reach this node by"),
          heap_mb: int = typer.Option(512, help="kafka: the JVM's heap"),
          config: Optional[Path] = _CONFIG) -> None:
    """Run one server in the foreground on a host of its own, serving on every interface (a run across hosts or
    containers: docs/deploy.md); it stops on SIGTERM and exits when the server does."""
    from .errors import InfraError
    from .serve import kafka_node, s3_server
    from .serve import serve as serve_one
    from .settings import Settings

    try:
        settings = Settings(config=str(config)) if config else Settings()
        if server == "kafka":
            if not (voters and cluster_id and advertise):
                raise InfraError("serve kafka needs --voters, --cluster-id and --advertise")
            node = kafka_node(settings, node_id, voters, cluster_id, advertise, heap_mb)
        elif server == "s3":
            node = s3_server(settings)
        else:
            raise InfraError(f"unknown server {server!r}: expected kafka or s3")
        raise typer.Exit(serve_one(node))
    except InfraError as e:
        _fail(e)


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
