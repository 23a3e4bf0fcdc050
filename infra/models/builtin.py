"""Built-in model names (``tiny``, ``tiny:SEED``, ``smollm2``) and their cache under ``<cache>/models``.

Cache directory names carry the seed and a hash of the builder's inputs (``_cache_key``); changing
either invalidates every cache already built, so they change only with ``BUILDER_VERSION``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from .smollm2 import build_smollm2
from .tiny import TinySpec, build_tiny

# Bump when the builder's output changes for the same seed, so stale cache entries are not reused.
BUILDER_VERSION = 1


def parse_builtin(name: str) -> tuple[str, int] | None:
    """``"tiny"`` -> ("tiny", 0), ``"tiny:7"`` -> ("tiny", 7), ``"smollm2"`` -> ("smollm2", 0), else None."""
    base, _, seed = name.partition(":")
    if base not in ("tiny", "smollm2"):
        return None
    if base == "smollm2" and seed:
        raise ValueError("smollm2 takes no seed")
    try:
        return base, int(seed or 0)
    except ValueError:
        raise ValueError(f"bad seed in model name {name!r}: expected tiny:<integer>") from None


def _cache_key(base: str, seed: int) -> str:
    spec = asdict(TinySpec()) if base == "tiny" else {}
    blob = json.dumps({"v": BUILDER_VERSION, "base": base, "seed": seed, "spec": spec}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_model(name: str = "tiny", cache_dir: str | Path | None = None) -> Path:
    """Local directory of a built-in model, built once into ``<cache>/models`` (safe across processes)."""
    from infra.settings import CACHE_DIR

    parsed = parse_builtin(name)
    if parsed is None:
        raise ValueError(f"unknown built-in model {name!r}: expected tiny, tiny:<seed> or smollm2")
    base, seed = parsed
    cache = Path(cache_dir) if cache_dir else CACHE_DIR
    final = cache / "models" / (f"tiny-s{seed}-{_cache_key(base, seed)}" if base == "tiny" else f"smollm2-{_cache_key(base, 0)}")
    return build_once(final, lambda tmp: build_tiny(tmp, seed) if base == "tiny" else build_smollm2(tmp, cache))


def build_once(final: Path, build: Callable[[Path], object]) -> Path:
    """``final``, built by ``build(directory)`` unless it is there (marked by its polarstream.json).

    One builder at a time (a lock file beside it): a concurrent caller, such as another test worker on a
    new machine, waits for that build instead of making its own copy on the same cores. Built beside the
    final place and renamed, so nobody ever sees a half-written one, even after a builder is killed."""
    if (final / "polarstream.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released with the file, also when this process dies
        if (final / "polarstream.json").exists():  # built while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            build(tmp)
            shutil.rmtree(final, ignore_errors=True)  # unmarked: left by a builder of an older layout, never whole
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
