"""The Maven fetch: versions from the pom, a versioned cache, no Maven run once the cache is complete."""

from __future__ import annotations

import pytest

from infra import maven
from infra.errors import InfraError
from infra.settings import Settings


def test_versions_come_from_the_pom():
    assert maven.pom_property("kafka.version").startswith("4.")
    assert maven.pom_property("s3proxy.version")
    with pytest.raises(InfraError, match="no <nope> property"):
        maven.pom_property("nope")


def test_cache_dir_names_version_and_pom(tmp_path):
    s = Settings(cache_dir=tmp_path)
    d = maven.jar_dir("kafka", s)
    assert d.parent == tmp_path / "maven" and d.name.startswith(f"kafka-{maven.pom_property('kafka.version')}-")
    with pytest.raises(InfraError, match="unknown Maven profile"):
        maven.jar_dir("zookeeper", s)


def test_complete_cache_is_reused_without_maven(tmp_path, monkeypatch):
    s = Settings(cache_dir=tmp_path)
    target = maven.jar_dir("kafka", s)
    target.mkdir(parents=True)
    (target / "kafka_2.13.jar").write_bytes(b"")
    (target / ".complete").write_text("done")

    def no_maven(*a, **k):
        raise AssertionError("Maven ran although the cache was complete")

    monkeypatch.setattr(maven, "_run_maven", no_maven)
    assert maven.fetch("kafka", s) == target
    assert maven.classpath("kafka", s) == f"{target}/*"


def test_missing_maven_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no mvn here
    with pytest.raises(InfraError, match="mvn not found on PATH"):
        maven.fetch("s3proxy", Settings(cache_dir=tmp_path))
