"""``polarstream rollout | submit | status | cancel``: the rollout server and its command-line client."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

_URL_HELP = "rollout server URL (default: http://127.0.0.1:<settings.rollout_port>)"


def _settings(config: Optional[Path]):
    from infra.settings import Settings

    return Settings(config=str(config)) if config else Settings()


def _url(url: Optional[str], config: Optional[Path]) -> str:
    return (url or f"http://127.0.0.1:{_settings(config).rollout_port}").rstrip("/")


def _request(method: str, url: str, token: Optional[str], **kw):
    """One HTTP call to the rollout server; its errors become one clear line and exit code 1."""
    import httpx

    headers = {"x-polar-control-token": token} if token else {}
    try:  # a host that does not answer fails in seconds; a busy server gets its two minutes
        resp = httpx.request(method, url, headers=headers, timeout=httpx.Timeout(120, connect=5), **kw)
    except httpx.HTTPError as e:
        typer.echo(f"error: cannot reach the rollout server at {url} ({e}); is it running? `polarstream rollout` starts it",
                   err=True)
        raise typer.Exit(1) from None
    if resp.status_code >= 400:
        try:
            err = resp.json()["error"]
            typer.echo(f"error: {err['message']} ({err['code']}, HTTP {resp.status_code})", err=True)
        except (ValueError, KeyError, TypeError):
            typer.echo(f"error: HTTP {resp.status_code}: {resp.text[:300]}", err=True)
        raise typer.Exit(1)
    return resp.json()


def rollout(
    host: str = typer.Option("127.0.0.1", help="listen address"),
    port: Optional[int] = typer.Option(None, help="listen port (default: settings.rollout_port)"),
    token: Optional[str] = typer.Option(None, envvar="POLAR_CONTROL_TOKEN", help="require this X-Polar-Control-Token to submit/cancel"),
    config: Optional[Path] = typer.Option(None, help="settings YAML"),
) -> None:
    """Serve the rollout API (OpenAPI at /docs): tasks fan out to sessions that gateway nodes run."""
    import uvicorn

    from infra.reach import require_free_port, require_kafka

    from .rollout.server import create_rollout_app

    settings = _settings(config)
    require_free_port(port or settings.rollout_port, host)
    require_kafka(settings, wait_s=settings.wait_for_s)
    uvicorn.run(create_rollout_app(settings, control_token=token), host=host, port=port or settings.rollout_port, log_level="warning")


def submit(
    tasks_file: Path = typer.Argument(..., help="tasks: JSON lines of TaskRequest or flat rows, a .parquet file, or Harbor "
                                                 "task directories ('-': JSON lines on stdin); see producers/tasks.py"),
    url: Optional[str] = typer.Option(None, help=_URL_HELP),
    token: Optional[str] = typer.Option(None, envvar="POLAR_CONTROL_TOKEN"),
    config: Optional[Path] = typer.Option(None, help="settings YAML"),
) -> None:
    """Submit tasks; every task is read and validated first, so a bad source submits nothing."""
    import sys

    from .tasks import TaskSourceError, load_tasks, task_lines

    try:
        loaded = task_lines(sys.stdin.read(), "-") if str(tasks_file) == "-" else load_tasks(tasks_file)
    except TaskSourceError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    tasks = [json.loads(t.model_dump_json()) for t in loaded]
    base = _url(url, config)
    for task in tasks:
        out = _request("POST", f"{base}/tasks", token, json=task)
        typer.echo(f"submitted {out['task_id']}: {len(out['sessions'])} sessions (group {out['group_id']})")


def status(
    task_id: Optional[str] = typer.Argument(None, help="one task (default: all)"),
    url: Optional[str] = typer.Option(None, help=_URL_HELP),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
    config: Optional[Path] = typer.Option(None, help="settings YAML"),
) -> None:
    """Per-task progress: sessions by stage, outcomes, usable samples, mean reward."""
    base = _url(url, config)
    data = _request("GET", f"{base}/tasks/{task_id}" if task_id else f"{base}/tasks", None)
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    for t in [data] if task_id else data:
        st = t["stages"]
        mean = "-" if t["reward_mean"] is None else f"{t['reward_mean']:.3f}"
        typer.echo(f"{t['task_id']:<24} {t['state']:<9} finished {t['finished']}/{t['num_samples']}  running {st['started']}  "
                   f"usable {t['usable']}  reward {mean}  {json.dumps(t['statuses'])}")


def cancel(
    task_id: str = typer.Argument(..., help="the task to cancel"),
    reason: str = typer.Option("cancelled", help="recorded with the cancelled sessions"),
    url: Optional[str] = typer.Option(None, help=_URL_HELP),
    token: Optional[str] = typer.Option(None, envvar="POLAR_CONTROL_TOKEN"),
    config: Optional[Path] = typer.Option(None, help="settings YAML"),
) -> None:
    """Cancel a task: nodes stop its sessions in every stage."""
    out = _request("DELETE", f"{_url(url, config)}/tasks/{task_id}", token, params={"reason": reason})
    typer.echo(f"cancelled {out['task_id']}: {out['finished']}/{out['num_samples']} had finished")


def register(app: typer.Typer) -> None:
    """Add the rollout commands to the root ``polarstream`` command."""
    app.command("rollout")(rollout)
    app.command("submit")(submit)
    app.command("status")(status)
    app.command("cancel")(cancel)
