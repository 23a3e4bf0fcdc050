"""The ``polarstream`` command. Each component contributes its subcommands through ``register(app)``.

Component CLI modules import only light modules at top level; heavy ones (torch, faust) are imported
inside the command that needs them, so ``polarstream --help`` stays fast.
"""

from __future__ import annotations

from importlib import import_module

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__.splitlines()[0])

# (module providing register(app)); order is the order of --help.
_COMPONENTS = (
    "infra.cli",
    "engine.cli",
    "gateway.cli",
    "gateway.node.cli",
    "streams.cli",
    "trainer.cli",
    "producers.cli",
    "polarstream.tools_cli",
    "polarstream.tools.forget",
    "polarstream.demo_cli",
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
