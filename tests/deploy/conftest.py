"""The deploy tests' one fixture: ``slurm``, a real one-node Slurm cluster on this machine (tests/deploy/slurm.py)."""

import os
from collections.abc import Iterator

import pytest

from .slurm import LocalSlurm, missing


@pytest.fixture(scope="module")
def slurm() -> Iterator[LocalSlurm]:
    if missing():
        pytest.skip(f"not installed: {', '.join(missing())} (`make system` installs slurm-wlm and munge)")
    if os.geteuid() != 0:  # slurmd runs every job step as its user: it must be able to become them
        pytest.skip("the one-node Slurm cluster runs its daemons as root (SlurmUser=root)")
    cluster = LocalSlurm()
    try:
        yield cluster.start()
    finally:
        cluster.stop()
