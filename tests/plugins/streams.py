"""Fixtures for the stream processors (helpers live in tests/streams/helpers.py, shared with the bench)."""

from __future__ import annotations

import pytest

from tests.streams.helpers import WorkerProcess


@pytest.fixture
def streams_worker(polar_settings, tmp_path):
    """Factory: ``streams_worker(*args, settings=...)`` starts a worker (with the test's settings unless
    given others); all are stopped at teardown."""
    workers: list[WorkerProcess] = []

    def make(*args: str, settings=None) -> WorkerProcess:
        w = WorkerProcess(settings or polar_settings, tmp_path / f"worker{len(workers)}.log", list(args))
        workers.append(w)
        return w.start()

    yield make
    for w in workers:
        w.stop()
