"""Runtimes: where a harness (and its evaluator) runs.

``subprocess`` (trusted, on the host), ``bwrap`` (bubblewrap sandbox: workspace + read-only system, no
network but the gateway, prlimit limits), ``docker`` and ``apptainer`` (for clusters; same contract).
"""

from __future__ import annotations

from pathlib import Path

from .base import ExecResult, ExecSpec, Limits, Runtime, RuntimeUnavailable, command_env
from .bwrap import BwrapRuntime
from .container import ApptainerRuntime, DockerRuntime
from .local import SubprocessRuntime

RUNTIMES = ("subprocess", "bwrap", "docker", "apptainer")


def make_runtime(name: str, sock_path: Path | None = None, image: str = "") -> Runtime:
    """A runtime by name; ``sock_path`` is the node's gateway socket, ``image`` the container image."""
    if name == "subprocess":
        return SubprocessRuntime()
    if name == "bwrap":
        return BwrapRuntime(sock_path)
    if name in ("docker", "apptainer"):
        if not image:
            raise ValueError(f"runtime {name!r} needs an image (--image)")
        return DockerRuntime(image, sock_path) if name == "docker" else ApptainerRuntime(image, sock_path)
    raise ValueError(f"unknown runtime {name!r}; expected one of {', '.join(RUNTIMES)}")


__all__ = ["RUNTIMES", "ExecResult", "ExecSpec", "Limits", "Runtime", "RuntimeUnavailable", "command_env", "make_runtime",
           "BwrapRuntime", "DockerRuntime", "ApptainerRuntime", "SubprocessRuntime"]
