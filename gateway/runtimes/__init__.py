"""Runtimes: where a harness (and its evaluator) runs.

``subprocess`` (trusted, on the host), ``bwrap`` (bubblewrap sandbox: workspace + read-only system, no
network but the gateway, prlimit limits), ``podman`` / ``docker`` (a container per session, from the
task's own image: podman.py), ``apptainer`` (clusters) and ``auto``: podman for a task with an image,
bwrap for a workspace task.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .base import ExecResult, ExecSpec, HostSandbox, Limits, Runtime, RuntimeUnavailable, command_env
from .bwrap import BwrapRuntime
from .container import ApptainerRuntime
from .images import ImageBuildError
from .local import SubprocessRuntime
from .podman import ContainerRuntime, ContainerSandbox

RUNTIMES = ("auto", "subprocess", "bwrap", "podman", "docker", "apptainer")


class AutoRuntime:
    """bwrap for workspace tasks, a container engine for tasks that bring an image (``runtime: auto``)."""

    name = "auto"
    persistent = False

    def __init__(self, host: Runtime, containers: ContainerRuntime):
        self.host, self.containers = host, containers
        self.python = host.python

    def __getattr__(self, attr):  # views and run() of a workspace task: the host sandbox's
        return getattr(self.host, attr)

    async def open(self, task, root: Path, ro_paths: list[Path] = (), node_binary: bool = False,
                   log_path: Path | None = None) -> Runtime:
        if task.environment is not None:
            return await self.containers.open(task, root, ro_paths, node_binary, log_path)
        return await self.host.open(task, root, ro_paths, node_binary, log_path)

    async def close(self) -> None:
        return None


def container_engine() -> str:
    """podman where it is installed, else docker, else "" (neither)."""
    return next((e for e in ("podman", "docker") if shutil.which(e)), "")


def make_runtime(name: str, sock_path: Path | None = None, image: str = "", owner: str = "", site_settings: str = "",
                 **containers) -> Runtime:
    """A runtime by name; ``sock_path`` is the node's gateway socket, ``image`` the image for workspace
    tasks under a container engine, ``owner`` the label a node's containers carry (its work dir),
    ``site_settings`` whether the host's CA, proxies and index go into containers (site.py; "" = default);
    ``containers``: ContainerRuntime's ``prepared``, ``max_starting`` and ``starts_per_s`` (prepared.py)."""
    if name == "subprocess":
        return SubprocessRuntime()
    if name == "bwrap":
        return BwrapRuntime(sock_path)
    if name in ("podman", "docker"):
        return ContainerRuntime(sock_path, engine=name, image=image, owner=owner, site_settings=site_settings, **containers)
    if name == "apptainer":
        if not image:
            raise ValueError("runtime 'apptainer' needs an image (--image)")
        return ApptainerRuntime(image, sock_path)
    if name == "auto":
        host = BwrapRuntime(sock_path) if shutil.which("bwrap") else SubprocessRuntime()
        return AutoRuntime(host, ContainerRuntime(sock_path, engine=container_engine() or "podman", image=image, owner=owner,
                                                  site_settings=site_settings, **containers))
    raise ValueError(f"unknown runtime {name!r}; expected one of {', '.join(RUNTIMES)}")


__all__ = ["RUNTIMES", "AutoRuntime", "ExecResult", "ExecSpec", "HostSandbox", "ImageBuildError", "Limits", "Runtime",
           "RuntimeUnavailable", "command_env", "make_runtime", "container_engine", "BwrapRuntime", "ContainerRuntime",
           "ContainerSandbox", "ApptainerRuntime", "SubprocessRuntime"]
