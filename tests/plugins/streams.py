"""Fixtures for the stream processors (helpers live in streams/testing.py, shared with the bench)."""

from __future__ import annotations

import pytest

from streams.testing import WorkerProcess


@pytest.fixture
def streams_worker(polar_settings, tmp_path):
    """Factory: ``streams_worker(*args)`` starts a worker; all are stopped at teardown."""
    workers: list[WorkerProcess] = []

    def make(*args: str) -> WorkerProcess:
        w = WorkerProcess(polar_settings, tmp_path / f"worker{len(workers)}.log", list(args))
        workers.append(w)
        return w.start()

    yield make
    for w in workers:
        w.stop()
