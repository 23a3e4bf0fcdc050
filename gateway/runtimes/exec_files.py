"""A container run with its files in one ``exec``: inputs in as a tar on stdin, outputs back as a tar on stdout.

A Harbor verifier in a session container needs its tests at /tests, an empty /logs/verifier, and what it
wrote there back on the host. Done with ``exec mkdir``, ``cp`` in, ``exec``, ``cp`` out, that is four
engine calls of 0.15–0.4 s each (each one starts the engine's CLI); the agent's processes killed first is
a fifth. Here it is one: ``WRAPPER`` runs as the exec's program, kills what the agent left (when asked:
the exec then runs as root, the image's own user when that is root), makes the directories, unpacks
stdin, runs the program with its stdout and stderr both on stderr (the run's log) and writes the output
directories to stdout as a tar. An image without ``tar`` says so (``NO_TAR`` on stdout, before anything
ran) and the caller falls back to the engine's ``cp``.
"""

from __future__ import annotations

import io
import shutil
import tarfile
import tempfile
from pathlib import Path

NO_TAR = b"polarstream: no tar in the image\n"

# $1: 1 = kill the agent's processes first; then the directories to make, "--", the outputs (relative
# to /), "--", whether stdin holds a tar (1/0), then the program. `kill -9 -1` spares PID 1 and itself.
WRAPPER = r"""
[ "$1" = 1 ] && kill -9 -1 2>/dev/null; shift
command -v tar >/dev/null 2>&1 || { printf 'polarstream: no tar in the image\n'; exit 0; }
while [ "$1" != -- ]; do mkdir -p "$1" || exit 125; shift; done; shift
outs=""; while [ "$1" != -- ]; do outs="$outs $1"; shift; done; shift
if [ "$1" = 1 ]; then tar -x -o -C / >&2 || exit 125; fi; shift
"$@" </dev/null >&2
rc=$?
[ -z "$outs" ] || tar -c -C / $outs 2>/dev/null
exit $rc
"""


def wrapped(argv: list[str], kill: bool, inputs: dict[str, Path], outputs: dict[str, Path]) -> list[str]:
    """``argv`` under ``WRAPPER`` (pure); ``inputs`` and ``outputs`` by the absolute path the program
    sees them at. The paths are the node's own (/tests, /logs/verifier), never a task's."""
    dirs = [*inputs, *outputs]
    outs = [seen_at.lstrip("/") or "." for seen_at in outputs]
    return ["/bin/sh", "-c", WRAPPER, "sh", "1" if kill else "0", *dirs, "--", *outs, "--",
            "1" if inputs else "0", *argv]


def pack(inputs: dict[str, Path]) -> bytes:
    """The input directories' contents as one tar, each under its path in the container."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for seen_at, host in inputs.items():
            tar.add(str(host), arcname=seen_at.lstrip("/"))
    return buf.getvalue()


def unpack(data: bytes, outputs: dict[str, Path]) -> None:
    """The output directories out of the run's tar into their host directories (``data`` filter: no
    member may land outside, whatever the container put there)."""
    if not data or not outputs:
        return
    first = next(iter(outputs.values()))
    with tempfile.TemporaryDirectory(dir=first.parent) as tmp:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            tar.extractall(tmp, filter="data")
        for seen_at, host in outputs.items():
            got = Path(tmp) / seen_at.lstrip("/")
            if got.is_dir():
                shutil.copytree(got, host, dirs_exist_ok=True)
