"""``polarstream ui``: serve the viewer (imports of Kafka, uvicorn and the tokenizer happen when it runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def ui_command(
    port: int = typer.Option(8090, help="port to serve on"),
    host: str = typer.Option("127.0.0.1", help="address to bind; anything but loopback requires the admin token"),
    prefix: Optional[list[str]] = typer.Option(None, help="topic prefix of a run to show; repeat for several "
                                               "(default: the settings' POLAR_TOPIC_PREFIX)"),
    model: Optional[str] = typer.Option(None, help="tokenizer to render traces as text (a local HF directory or a "
                                        "built-in name such as tiny); without it token ids are shown"),
    config: Optional[Path] = typer.Option(None, help="settings YAML (else POLAR_* environment)"),
) -> None:
    """A read-only web view of recorded runs: groups, sessions with their chains, traces token by token."""
    import logging

    import uvicorn

    from infra.reach import require_free_port, require_kafka
    from infra.settings import DEV_ADMIN_TOKEN, Settings

    from .app import create_app, needs_token
    from .index import RunIndex
    from .reader import Reader

    require_free_port(port, host)
    base = Settings(config=str(config)) if config else Settings()
    decode = _decoder(model) if model else None
    require_kafka(base, wait_s=base.wait_for_s)
    runs = [RunIndex(p) for p in dict.fromkeys(prefix or [base.topic_prefix])]
    token = base.admin_token if needs_token(host) else None
    if token == DEV_ADMIN_TOKEN:
        logging.getLogger("polarstream.viewer").warning(
            "the viewer is bound to %s with the development admin token: set POLAR_ADMIN_TOKEN", host)
    readers = [Reader(base.model_copy(update={"topic_prefix": r.prefix}), r) for r in runs]
    for r in readers:
        r.start()
    typer.echo(f"polarstream ui: http://{host}:{port}/" + ("  (admin token required: ?token=...)" if token else ""),
               err=True)
    try:
        uvicorn.run(create_app(runs, admin_token=token, decode=decode), host=host, port=port, log_level="warning")
    finally:
        for r in readers:
            r.stop()


def _decoder(model: str):
    """Token id -> text with ``model``'s tokenizer (the gateway's loader and cached one-token decoder)."""
    from gateway.redact import token_decoder
    from gateway.template import ChatTemplate
    from infra.models import resolve_tokenizer_model

    return token_decoder(ChatTemplate.load(resolve_tokenizer_model(model)).tokenizer)


def register(app: typer.Typer) -> None:
    """Add ``ui`` to the root command."""
    app.command("ui")(ui_command)
