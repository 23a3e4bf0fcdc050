"""Closed sessions, kept on disk so that a restarted gateway still refuses their keys.

A session the node dropped (finished) or an operator forgot (``DELETE /admin/sessions/{id}``) is
*closed*: its key must record no more calls, or they would land in a session the streams have already
assembled. The gateway remembers that in memory (``SessionStore``); this file is what survives a
restart: one JSON line per closed session, ``[session_id, expires_at]``, appended with a single
``write`` (O_APPEND, so gateway processes sharing the file do not interleave lines). A SIGKILL loses
nothing written; only a machine crash can lose the last lines (no fsync: a close is not worth a disk
flush per session). Loading skips expired lines and rewrites the file when most of it has expired,
under an exclusive ``flock`` that appenders share, so no append lands in the replaced file.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import orjson

log = logging.getLogger("polar.gateway")


class TombstoneFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def load(self, now: float | None = None) -> dict[str, float]:
        """Unexpired closed sessions (session id -> unix time the tombstone may be forgotten)."""
        if not self.path.exists():
            return {}
        now = time.time() if now is None else now
        with self._locked(fcntl.LOCK_EX):
            lines = self.path.read_bytes().splitlines()
            live: dict[str, float] = {}
            for n, line in enumerate(lines, 1):
                try:
                    sid, expires = orjson.loads(line)
                    if expires > now:
                        live[sid] = max(float(expires), live.get(sid, 0.0))
                except (orjson.JSONDecodeError, ValueError, TypeError):  # only a machine crash tears a line
                    log.warning("%s:%d: not a tombstone line, skipped", self.path, n)
            if len(lines) > 2 * len(live) + 64:  # mostly expired: rewrite (atomically) what is still live
                self._rewrite(live)
        return live

    def append(self, session_id: str, expires_at: float) -> None:
        with self._locked(fcntl.LOCK_SH) as fd:
            os.write(fd, orjson.dumps([session_id, expires_at]) + b"\n")

    @contextlib.contextmanager
    def _locked(self, how: int) -> Iterator[int]:
        """The file open for appending, locked; reopened if a rewrite replaced it while we waited."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, how)
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    yield fd
                    return
            finally:
                os.close(fd)  # closing releases the lock

    def _rewrite(self, live: dict[str, float]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_bytes(b"".join(orjson.dumps([sid, exp]) + b"\n" for sid, exp in live.items()))
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.path)
