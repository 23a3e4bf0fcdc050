"""``polarstream node`` (a gateway node) and ``polarstream harness install|list`` (the npm CLIs)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

harness_app = typer.Typer(no_args_is_help=True, add_completion=False, help="Install and list the harness CLIs.")


def _settings(config: Optional[Path]):
    from infra.settings import Settings

    return Settings(config=str(config)) if config else Settings()


@harness_app.command("install")
def install(
    names: Optional[list[str]] = typer.Argument(None, help="harnesses to install (default: all six)"),
    force: bool = typer.Option(False, help="reinstall even when the pinned version is present"),
    config: Optional[Path] = typer.Option(None, help="settings YAML (cache_dir)"),
) -> None:
    """Install the pinned harness CLIs from npm into <cache_dir>/npm (idempotent)."""
    from gateway.harnesses.install import NPM_HARNESSES, install as do_install

    cache = _settings(config).cache_dir
    unknown = [n for n in names or [] if n not in NPM_HARNESSES]
    if unknown:
        raise typer.BadParameter(f"unknown harness(es) {', '.join(unknown)}; expected {', '.join(NPM_HARNESSES)}", param_hint="NAMES")
    failed = 0
    for name in names or list(NPM_HARNESSES):
        r = do_install(name, cache, force=force, log=lambda m: typer.echo(m, err=True))
        typer.echo(f"{name:<12} {r['version']:<9} {r['status']:<9} {r['seconds']:>5}s {r['detail']}")
        failed += r["status"] == "failed"
    if failed:
        raise typer.Exit(1)


@harness_app.command("list")
def list_harnesses(config: Optional[Path] = typer.Option(None, help="settings YAML (cache_dir)")) -> None:
    """Each harness, its pinned version and whether it is installed."""
    from gateway.harnesses.install import NPM_HARNESSES, installed_version

    cache = _settings(config).cache_dir
    for name, h in NPM_HARNESSES.items():
        have = installed_version(name, cache)
        typer.echo(f"{name:<12} {h.spec:<40} {'installed' if have == h.version else (have or 'missing')}")
    typer.echo(f"{'command':<12} {'(any program)':<40} built in")
    typer.echo(f"{'builtin':<12} {'gateway/harnesses/builtin.py':<40} built in")


@harness_app.command("merge-report")
def merge_report_cmd(
    out: Optional[Path] = typer.Option(None, "--out", help="also write the JSON report here"),
    markdown: bool = typer.Option(False, "--markdown", help="print a markdown table instead of JSON"),
    config: Optional[Path] = typer.Option(None, help="settings YAML (Kafka, topic prefix)"),
) -> None:
    """Merge rate per harness/API from the recorded calls topic (see gateway/harnesses/report.py)."""
    import json

    from gateway.harnesses.report import markdown_table, read_calls, merge_report
    from infra.reach import require_kafka

    settings = _settings(config)
    require_kafka(settings, wait_s=settings.wait_for_s)
    report = merge_report(read_calls(settings))
    text = json.dumps(report, indent=2)
    if out is not None:
        out.write_text(text + "\n")
    typer.echo(markdown_table(report) if markdown else text)


def node(
    engine_url: list[str] = typer.Option(..., "--engine-url", help="engine base URL; repeat for several workers"),
    model: str = typer.Option(..., help="tokenizer + chat template: a local HF directory or a built-in name (tiny)"),
    runtime: str = typer.Option("bwrap", help="auto | subprocess | bwrap | podman | docker | apptainer (auto: podman or "
                                "docker for a task that brings an image, bwrap, else subprocess, for any other)"),
    image: str = typer.Option("", help="container image for tasks that bring none (podman, docker, apptainer)"),
    node_id: Optional[str] = typer.Option(None, help="name of this node (default: host + random suffix)"),
    work_dir: Optional[Path] = typer.Option(None, help="session directories (default: <data_dir>/node/<node_id>)"),
    init_workers: int = typer.Option(4, help="concurrent INIT stages"),
    ready_target: int = typer.Option(2, help="prepared sessions kept waiting for a run slot (READY buffer)"),
    run_workers: int = typer.Option(2, help="concurrent harness runs"),
    postrun_workers: int = typer.Option(4, help="concurrent evaluations"),
    container_starts: int = typer.Option(4, help="task containers starting at once, at most (prepared ahead or on demand)"),
    container_start_rate: float = typer.Option(8.0, help="task containers started per second, at most"),
    model_name: str = typer.Option("polar", help="model name the harnesses ask for"),
    cpu_s: Optional[int] = typer.Option(None, help="RLIMIT_CPU seconds per harness process"),
    memory_mb: Optional[int] = typer.Option(None, help="RLIMIT_AS MiB per harness process"),
    port: int = typer.Option(0, help="gateway port (0: a free one)"),
    host: str = typer.Option("127.0.0.1", help="the gateway's listen address (another host's trainer or driver reaches "
                                               "it: 0.0.0.0, with secret POLAR_ADMIN_TOKEN and POLAR_SESSION_SECRET)"),
    upstream: str = typer.Option("polar", help="engine wire format: polar | vllm | sglang"),
    temperature: float = typer.Option(1.0, help="the run's sampling temperature, pinned on its sessions (the trainer's)"),
    session_timeout_ms: int = typer.Option(10_000, help="Kafka group session timeout: how fast a dead node's sessions move"),
    keep_workdirs: bool = typer.Option(False, help="keep session directories (debugging)"),
    site_settings: str = typer.Option("", help="auto: the host's CA bundle, proxies and package index go into image builds "
                                               "and task containers (where it has them); off: not (default: "
                                               "$POLAR_SITE_SETTINGS, else auto)"),
    config: Optional[Path] = typer.Option(None, help="settings YAML (Kafka, topics, session secret)"),
    log_level: str = typer.Option("INFO", help="log level"),
) -> None:
    """Run a gateway node: host the gateway and run sessions from polar.sessions (INIT → READY → RUN → POSTRUN)."""
    import asyncio
    import logging
    import sys

    from gateway.cli import require_upstreams
    from gateway.config import GatewayConfig
    from gateway.runtimes import RUNTIMES
    from infra.models import resolve_tokenizer_model
    from infra.reach import require_free_port

    from .config import NodeConfig
    from .node import Node

    if runtime not in RUNTIMES:
        raise typer.BadParameter(f"{runtime!r}: expected one of {', '.join(RUNTIMES)}", param_hint="--runtime")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = _settings(config)
    require_free_port(port, host)  # 0: a free one is chosen
    model_dir = resolve_tokenizer_model(model)
    try:
        cfg = NodeConfig(work_dir=Path("."), cache_dir=settings.cache_dir, runtime=runtime, image=image,
                         init_workers=init_workers, ready_target=ready_target, run_workers=run_workers,
                         postrun_workers=postrun_workers, container_starts=container_starts,
                         container_start_rate=container_start_rate, model_name=model_name, cpu_s=cpu_s, memory_mb=memory_mb,
                         keep_workdirs=keep_workdirs, gateway_host=host, gateway_port=port, site_settings=site_settings,
                         **({"node_id": node_id} if node_id else {}))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    cfg.work_dir = (work_dir or settings.data_dir / "node" / cfg.node_id).absolute()
    require_upstreams(engine_url, settings)
    from gateway.sampling import SamplingPolicy

    try:
        policy = SamplingPolicy(temperature=temperature)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--temperature") from None
    gw = GatewayConfig(engine_urls=list(engine_url), model=model_dir, upstream=upstream,  # type: ignore[arg-type]
                       sampling=policy, tombstones=str(settings.data_dir / "gateway" / "tombstones.jsonl"))
    sys.exit(asyncio.run(Node(settings, cfg, gw, session_timeout_ms=session_timeout_ms).serve()))


def register(app: typer.Typer) -> None:
    """Add ``node`` and ``harness`` to the root command."""
    app.command("node")(node)
    app.add_typer(harness_app, name="harness")
