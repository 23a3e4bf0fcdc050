"""``polarstream images base NAME``: an offline stand-in for a base image that task Dockerfiles build FROM.

Where no registry answers, ``debian:<suite>[-slim]``, ``python:<version>[-slim][-<suite>]`` (a version
some Debian suite ships: 3.13 is trixie's, 3.11 bookworm's) and ``ubuntu:<release>`` (the nearest Debian
suite) are built from Debian's own packages with mmdebstrap (gateway/runtimes/images.py, ``build_base``)
and imported under the name asked for, labelled ``io.polarstream.standin``. A stand-in is not the
registry's image: the command says so, and what it holds instead. Task images build their bases this way by themselves
when they need one; the command makes one ahead of time, or again (``--force``).
"""

from __future__ import annotations

import re
from typing import Annotated

import typer

images_app = typer.Typer(no_args_is_help=True, add_completion=False,
                         help="Base images for tasks that bring a Dockerfile (offline Debian stand-ins), and the project's own image.")


def describe(name: str, suite: str, extra: list[str]) -> str:
    """What the stand-in for ``name`` holds, said against what the name promises."""
    from gateway.runtimes.images import DEBIAN_PYTHON

    python = DEBIAN_PYTHON.get(suite, "")
    what = f"Debian {suite} minbase + python3 {python} from Debian's packages".replace("  ", " ")
    if extra:
        what += f" (with {', '.join(extra)})"
    what += ", not the registry's image"
    if name.split("/")[-1].startswith("ubuntu:"):
        what += "; Debian, not Ubuntu (Ubuntu's package versions may differ)"
    asked = re.match(r"python:(\d+\.\d+)", name.split("/")[-1])
    if asked and python and asked.group(1) != python:
        what += f"; its python is {python}, not the {asked.group(1)} the name asks for"
    return what


@images_app.command("base")
def base_command(
    image_name: Annotated[str, typer.Argument(metavar="NAME", help="the image a Dockerfile's FROM names, e.g. "
                                                                   "debian:bookworm-slim or python:3.11-slim-bookworm")],
    force: Annotated[bool, typer.Option("--force", help="build it again even when an image of that name is present")] = False,
    container_engine: Annotated[str, typer.Option(help="the container engine to import it into: podman or docker")] = "podman",
) -> None:
    """Build an offline stand-in for base image NAME from Debian's packages (mmdebstrap), under NAME."""
    import asyncio
    import shutil

    from gateway.runtimes.images import (DEBIAN_PYTHON, RECIPE_LABEL, STANDIN_LABEL, UBUNTU_SUITE, ImageBuildError, build_base,
                                         engine_argv, qualified, recipe_id, standin_recipe)

    recipe = standin_recipe(name := image_name.strip())
    if recipe is None:
        pythons = ", ".join(f"{v} ({s})" for s, v in DEBIAN_PYTHON.items())
        typer.echo(f"error: {name}: no offline stand-in for it; stand-ins are made for debian:<suite>[-slim], "
                   f"ubuntu:<release> ({', '.join(r for r in UBUNTU_SUITE if '.' in r)}) and python:<version>[-slim][-<suite>] "
                   f"of a version a Debian suite ships: {pythons}", err=True)
        raise typer.Exit(1)
    if not shutil.which(container_engine):
        typer.echo(f"error: {container_engine} is not installed (Debian: apt-get install podman runc mmdebstrap; `make system` does it)", err=True)
        raise typer.Exit(1)
    suite, extra = recipe
    tag = qualified(name)
    if not force:
        found = next(((n, v) for n in (name, tag) if (v := _label(engine_argv(container_engine), n, STANDIN_LABEL)) is not None), None)
        old = found is not None and found[1] and _label(engine_argv(container_engine), found[0], RECIPE_LABEL) != recipe_id(recipe)
        if old:  # what tasks would otherwise find: made again, as ensure_base would
            typer.echo(f"{name} is present as a stand-in of an older recipe; building it again")
        elif found is not None:
            kind = f"a stand-in ({describe(name, suite, extra)})" if found[1] else "not a stand-in of ours (pulled, or imported by hand)"
            where = "" if found[0] == name else f" as {found[0]}"
            typer.echo(f"{name} is present{where}: {kind}; --force builds the stand-in again")
            return
    typer.echo(f"building a stand-in for {name}: mmdebstrap {suite} --variant=minbase (a minute or more: it fetches Debian's packages)...")
    try:
        asyncio.run(build_base(name, container_engine))
    except ImageBuildError as e:
        typer.echo(f"error: {' '.join(str(e).split())}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"built {name} as a stand-in: {describe(name, suite, extra)} "
               f"(tag {tag}, label {STANDIN_LABEL}=debian-{suite}-minbase)")


@images_app.command("project")
def project_command(
    force: Annotated[bool, typer.Option("--force", help="build every layer again (--no-cache), to check it gives the same id")] = False,
    container_engine: Annotated[str, typer.Option(help="the container engine to build it with")] = "podman",
) -> None:
    """Build the project's own image (this checkout and its venv on Debian, offline): one image that runs every
    component by its polarstream command (docs/deploy.md)."""
    from polarstream.project_image import ProjectImageError, build_project_image, image_id

    typer.echo("building the project image (the first build makes its Debian rootfs and copies the venv: minutes)...")
    try:
        tag = build_project_image(container_engine, force=force)
        typer.echo(f"{tag} (id {image_id(tag, container_engine)[:12]}), also tagged latest")
    except ProjectImageError as e:
        typer.echo(f"error: {' '.join(str(e).split())}", err=True)
        raise typer.Exit(1) from None


def _label(argv: list[str], tag: str, label: str) -> str | None:
    """The image's ``label`` value ("" when it has none), or None when no image ``tag`` is found."""
    import subprocess

    out = subprocess.run([*argv, "image", "inspect", "--format", f'{{{{index .Labels "{label}"}}}}', tag],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        return None
    value = out.stdout.strip()
    return "" if value == "<no value>" else value


def register(app: typer.Typer) -> None:
    """Add ``images`` to the root command."""
    app.add_typer(images_app, name="images")
