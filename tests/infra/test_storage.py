"""The same storage code writes and reads s3:// (s3fs against the S3 server) and file://."""

from __future__ import annotations

import os

import pytest

from infra import storage
from infra.storage import StorageError


@pytest.fixture(params=["file", "s3"])
def root(request, polar_settings, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path / 'ckpt'}"
    return polar_settings.storage_url


def test_write_read_list_remove(root, polar_settings):
    s = polar_settings
    blob = os.urandom(3 * 1024 * 1024 + 17)
    target = storage.join(root, "step-3", "model.safetensors")
    assert not storage.exists(target, s)
    storage.write_bytes(target, blob, s)
    storage.write_bytes(storage.join(root, "step-3", "state.json"), b'{"step": 3}', s)
    assert storage.exists(target, s)
    assert storage.read_bytes(target, s) == blob
    assert storage.listdir(storage.join(root, "step-3"), s) == ["model.safetensors", "state.json"]
    storage.write_bytes(target, b"v2", s)  # overwrite in place
    assert storage.read_bytes(target, s) == b"v2"
    storage.remove(storage.join(root, "step-3"), s)
    assert not storage.exists(target, s)
    assert storage.listdir(storage.join(root, "step-3"), s) == []
    with pytest.raises(FileNotFoundError, match="no object at"):
        storage.read_bytes(target, s)


def test_s3_objects_land_in_the_servers_bucket(infra, polar_settings):
    url = storage.join(polar_settings.storage_url, "probe.bin")
    storage.write_bytes(url, b"xyz", polar_settings)
    key = url.removeprefix(f"s3://{polar_settings.s3_bucket}/")
    assert (infra.s3.objects_dir / polar_settings.s3_bucket / key).read_bytes() == b"xyz"


def test_local_write_is_atomic_and_leaves_no_temp_files(tmp_path, polar_settings):
    url = f"file://{tmp_path}/a/b.bin"
    storage.write_bytes(url, b"one", polar_settings)
    storage.write_bytes(url, b"two", polar_settings)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b.bin"]
    assert storage.read_bytes(str(tmp_path / "a" / "b.bin"), polar_settings) == b"two"  # a plain path works too


@pytest.mark.parametrize("url, problem", [("gs://bucket/x", "unsupported scheme 'gs'"), ("s3://", "names no bucket")])
def test_bad_urls(url, problem, polar_settings):
    with pytest.raises(StorageError, match=problem):
        storage.filesystem(url, polar_settings)
