"""Engine fixtures: the tiny model directory and real engine servers on free ports.

- ``tiny_model_dir`` (session): the seeded tiny Qwen3-style model (built once, cached under
  ``~/.cache/polarstream/models``), an HF directory with tokenizer and chat template.
- ``engine_server``: a real engine (uvicorn + the batching thread) serving the tiny model as ``tiny``
  on 127.0.0.1 at a free port, in a background thread of the test process; ``.url``, ``.model``.
- ``engine_server_factory(model_dir=None, script=None, settings=None, name="tiny", **EngineOptions)``:
  more of them, e.g. scripted (``script=path``) or with ``settings=polar_settings`` so weight updates
  can read ``s3://`` checkpoints from the test S3 server. All are stopped when the test ends.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.local import EngineServer, start_engine_server

__all__ = ["EngineServer", "start_engine_server"]


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny model's HF directory (seed 0), built once and cached across test sessions."""
    from infra.models import ensure_model

    return ensure_model("tiny")


@pytest.fixture
def engine_server_factory(tiny_model_dir):
    started: list[EngineServer] = []

    def make(model_dir: str | Path | None = None, **kwargs) -> EngineServer:
        server = start_engine_server(model_dir or tiny_model_dir, **kwargs)
        started.append(server)
        return server

    yield make
    for s in started:
        s.stop()


@pytest.fixture
def engine_server(engine_server_factory) -> EngineServer:
    """A fresh engine serving the tiny model as ``tiny`` (its own weights: updates do not leak)."""
    return engine_server_factory()
