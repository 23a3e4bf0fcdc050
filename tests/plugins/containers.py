"""Container fixtures: the podman engine (never skipped: `make test` installs it) and the offline Debian
base that published-style tasks' Dockerfiles build FROM."""

from __future__ import annotations

import asyncio
import shutil

import pytest

BASE = "debian:bookworm-slim"


@pytest.fixture(scope="session")
def podman_base() -> str:
    """``debian:bookworm-slim`` present in the machine's image store (pulled, or built once as a stand-in
    with mmdebstrap under a machine-wide lock, so parallel workers share one build)."""
    from gateway.runtimes.images import ensure_base

    assert shutil.which("podman"), "podman is not installed: run `make system` (apt-get install podman runc mmdebstrap)"
    asyncio.run(ensure_base(BASE, "podman"))
    return BASE
