"""vLLM's own wheel as the oracle: ``vllm_python`` (session) is the interpreter of the peer venv ``make vllm-peer``
builds (``$POLAR_CACHE_DIR/peers/vllm-venv``, else ``~/.cache/polarstream/peers/vllm-venv``; ``POLAR_VLLM_PYTHON``
names another). A test that needs it skips, saying how to build it, when there is none. vLLM cannot live in our
venv (its CUDA torch and pins), so its code runs there, as a subprocess, and ours here."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


def vllm_peer_python() -> Path | None:
    """The peer venv's python if it imports vLLM's weight-transfer package, else None."""
    env = os.environ.get("POLAR_VLLM_PYTHON")
    roots = [Path(os.environ["POLAR_CACHE_DIR"])] if os.environ.get("POLAR_CACHE_DIR") else []
    roots.append(Path.home() / ".cache" / "polarstream")
    for py in ([Path(env)] if env else []) + [r / "peers" / "vllm-venv" / "bin" / "python" for r in roots]:
        if py.is_file():
            ok = subprocess.run([str(py), "-c", "import vllm.distributed.weight_transfer"], capture_output=True,
                                timeout=300)
            if ok.returncode == 0:
                return py
    return None


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    py = vllm_peer_python()
    if py is None:
        pytest.skip("no vLLM peer venv (vllm==0.33.0): run `make vllm-peer`, or set POLAR_VLLM_PYTHON")
    return py
