"""polarstream: reinforcement learning of coding agents from their model calls.

The first line above is what ``polarstream --help`` opens with. Each component contributes its
subcommands through ``register(app)``; ``ORDER`` lists them in the order a user meets them.

Component CLI modules import only light modules at top level; heavy ones (torch, faust) are imported
inside the command that needs them, so ``polarstream --help`` stays fast.

A failure a command expects (a missing file, a service not running, a port in use, malformed YAML,
refused credentials) ends as one ``error: ...`` line on stderr and exit code 1: polarstream/errors.py
says which and how. Anything else keeps its traceback, and ``--debug`` (POLAR_DEBUG=1) keeps it for all.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

import typer
from typer.core import TyperGroup

# The order of --help: how a user meets the commands. Commands not listed follow, as registered.
ORDER = ("demo", "run", "infra", "engine", "models", "gateway", "gateway-key", "node", "harness", "rollout", "tasks", "images", "submit",
         "status", "cancel", "streams", "train", "sft", "replay", "eval", "export", "cat", "forget", "ui")


class RootCommand(TyperGroup):
    """``polarstream``: lists its subcommands in ``ORDER`` and turns their expected failures into one line."""

    def list_commands(self, ctx: typer.Context) -> list[str]:
        rank = {name: i for i, name in enumerate(ORDER)}
        return sorted(super().list_commands(ctx), key=lambda name: rank.get(name, len(ORDER)))

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as e:
            from .errors import explain, one_line

            message = None if ctx.params.get("debug") else explain(e)
            if message is None:  # a bug, or --debug: the traceback shows
                raise
            typer.echo(f"error: {one_line(message)}", err=True)
            raise typer.Exit(1) from None


app = typer.Typer(cls=RootCommand, no_args_is_help=True, add_completion=False, help=__doc__.splitlines()[0])


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", envvar="POLAR_DEBUG",
                                     help="show the traceback of every error (also POLAR_DEBUG=1)")) -> None:
    pass  # --debug is read from ctx.params when a command fails (RootCommand.invoke)


# (module providing register(app)); the order of registration, --help follows ORDER.
_COMPONENTS = (
    "infra.cli",
    "engine.cli",
    "gateway.cli",
    "gateway.node.cli",
    "streams.cli",
    "trainer.cli",
    "trainer.sft_cli",
    "producers.cli",
    "polarstream.tools_cli",
    "polarstream.images_cli",
    "polarstream.tools.forget",
    "polarstream.demo_cli",
    "polarstream.viewer.cli",
)

for _name in _COMPONENTS:
    try:
        _mod = import_module(_name)
    except ModuleNotFoundError as e:  # a component not built yet; anything else is a real error
        if e.name != _name:
            raise
        continue
    _mod.register(app)


def main() -> None:
    app()
