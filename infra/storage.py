"""Object storage through fsspec: the same calls for ``file://`` paths and ``s3://`` on our S3 server.

``filesystem(url, settings)`` gives ``(fs, path)``; the helpers below add what checkpoints need on top:
an atomic write (a reader never sees half a file), read, exists, list, join.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import fsspec

from .settings import Settings

SCHEMES = ("file", "s3")


class StorageError(ValueError):
    """A storage URL this project cannot use."""


def filesystem(url: str, settings: Settings) -> tuple[fsspec.AbstractFileSystem, str]:
    """fsspec filesystem and the path inside it for ``url`` (file://, s3://, or a plain local path)."""
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    if scheme not in SCHEMES:
        raise StorageError(f"storage URL {url!r}: unsupported scheme {scheme!r}; use file:// or s3://")
    if scheme == "s3" and not url[len("s3://"):].strip("/"):
        raise StorageError(f"storage URL {url!r}: names no bucket")
    fs, path = fsspec.core.url_to_fs(url, **settings.storage_options(url))
    return fs, path


def join(url: str, *parts: str) -> str:
    """``url`` with path segments appended ('s3://b/run' + 'step-3' -> 's3://b/run/step-3')."""
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts)])


def write_bytes(url: str, data: bytes, settings: Settings) -> None:
    """Write ``data`` so that readers see the old object or the whole new one, never a part.

    S3 gives that by itself (an object appears when its upload completes); a local file is written
    beside its target, flushed to disk and renamed over it.
    """
    fs, path = filesystem(url, settings)
    if _is_local(fs):
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    else:
        fs.pipe_file(path, data)


def read_bytes(url: str, settings: Settings) -> bytes:
    """The object's bytes; FileNotFoundError naming the URL when it does not exist."""
    fs, path = filesystem(url, settings)
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"no object at {url}") from None


def exists(url: str, settings: Settings) -> bool:
    """True when an object (or directory) is at ``url``."""
    fs, path = filesystem(url, settings)
    return fs.exists(path)


def listdir(url: str, settings: Settings) -> list[str]:
    """Names (not paths) directly under ``url``; [] when there is nothing there."""
    fs, path = filesystem(url, settings)
    try:
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
    except FileNotFoundError:
        return []


def remove(url: str, settings: Settings) -> None:
    """Delete the object or tree at ``url`` (no error when absent)."""
    fs, path = filesystem(url, settings)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")
