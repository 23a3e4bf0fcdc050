"""The deploy tests' one fixture: ``slurm``, a real one-node Slurm cluster on this machine (tests/deploy/slurm.py)."""

from collections.abc import Iterator

import pytest

from .slurm import LocalSlurm, missing


@pytest.fixture(scope="module")
def slurm() -> Iterator[LocalSlurm]:
    if missing():
        pytest.skip(f"not installed: {', '.join(missing())} (`make system` installs slurm-wlm and munge)")
    cluster = LocalSlurm()
    try:
        yield cluster.start()
    finally:
        cluster.stop()
