#!/bin/bash
set -euo pipefail
cat > /app/semver.py <<'PY'
"""Version strings of our releases: MAJOR.MINOR.PATCH, optionally with a pre-release (1.4.0-rc.2)."""


def parse(version: str) -> tuple:
    """``"1.4.0-rc.2"`` -> ``("1", "4", "0", "rc.2")``."""
    core, _, pre = version.strip().partition("-")
    major, minor, patch = core.split(".")
    return major, minor, patch, pre


def _key(version: str) -> tuple:
    major, minor, patch, pre = parse(version)
    # A release sorts after its pre-releases; identifiers: numeric (numerically) before alphanumeric.
    ids = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in pre.split(".")) if pre else ()
    return int(major), int(minor), int(patch), 0 if pre else 1, ids


def sort_versions(versions: list[str]) -> list[str]:
    """Oldest first, as semver orders them."""
    return sorted(versions, key=_key)


def latest(versions: list[str]) -> str:
    return sort_versions(versions)[-1]
PY
