"""Fetch the servers' jars from Maven Central into the cache, once.

``classpath("kafka", settings)`` runs ``mvn dependency:copy-dependencies`` for one profile of
``infra/pom.xml`` the first time and returns the jar directory's classpath; afterwards it only checks a
stamp file. The directory name carries the profile's version and a hash of the pom, so editing the pom
fetches into a fresh directory and never mixes old and new jars.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

from .errors import InfraError
from .settings import Settings

POM = Path(__file__).with_name("pom.xml")
PROFILES = {"kafka": "kafka.version", "s3proxy": "s3proxy.version", "mirror": "mirror.version"}
_NS = {"m": "http://maven.apache.org/POM/4.0.0"}
_STAMP = ".complete"


def pom_property(name: str, pom: Path = POM) -> str:
    """A value from the pom's <properties> (e.g. kafka.version)."""
    node = ET.parse(pom).getroot().find(f"m:properties/m:{name}", _NS)
    if node is None or not (node.text or "").strip():
        raise InfraError(f"{pom}: no <{name}> property")
    return node.text.strip()


def maven_dir(settings: Settings) -> Path:
    """Root of the Maven cache: the local repository and one jar directory per profile."""
    return settings.cache_dir / "maven"


def jar_dir(profile: str, settings: Settings) -> Path:
    """Where ``profile``'s jars live: versioned and keyed by the pom's content."""
    if profile not in PROFILES:
        raise InfraError(f"unknown Maven profile {profile!r}; expected one of {', '.join(PROFILES)}")
    digest = hashlib.sha256(POM.read_bytes()).hexdigest()[:10]
    return maven_dir(settings) / f"{profile}-{pom_property(PROFILES[profile])}-{digest}"


def fetch(profile: str, settings: Settings) -> Path:
    """Jar directory for ``profile``, resolving it with Maven first if it is not complete yet."""
    target = jar_dir(profile, settings)
    if (target / _STAMP).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Two processes (two test sessions, or `infra up` in two shells) may fetch at once: the lock makes
    # the second wait and then find the stamp.
    with open(target.parent / f".{profile}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / _STAMP).exists():
            return target
        _run_maven(profile, target, settings)
    return target


def _run_maven(profile: str, target: Path, settings: Settings) -> None:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise InfraError("mvn not found on PATH: install Maven 3.8+ (e.g. apt-get install maven) to fetch Kafka and s3proxy")
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    cmd = [
        mvn, "-B", "-q", "-f", str(POM), "-P", profile,
        f"-Dmaven.repo.local={maven_dir(settings) / 'repository'}",
        "dependency:copy-dependencies", f"-DoutputDirectory={partial}", "-DincludeScope=runtime",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    jars = list(partial.glob("*.jar")) if partial.exists() else []
    if proc.returncode != 0 or not jars:
        out = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise InfraError(f"Maven could not resolve the {profile} jars (exit {proc.returncode}):\n{out}")
    (partial / _STAMP).write_text(" ".join(cmd))
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)  # atomic: a reader sees either no directory or a complete one


def classpath(profile: str, settings: Settings) -> str:
    """Java classpath (a directory wildcard) for ``profile``, fetching on first use."""
    return str(fetch(profile, settings) / "*")
