"""Module-scoped engines for the engine's own tests (starting one costs ~0.5 s; most tests only read)."""

import httpx
import pytest

from tests.plugins.engine import start_engine_server


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """A tiny-model engine with a small context (64 tokens) so the length errors are cheap to reach."""
    server = start_engine_server(tiny_model_dir, max_model_len=64, max_num_seqs=64)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    with httpx.Client(base_url=served.url, timeout=60) as c:
        yield c
