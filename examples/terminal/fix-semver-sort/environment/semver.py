"""Version strings of our releases: MAJOR.MINOR.PATCH, optionally with a pre-release (1.4.0-rc.2)."""


def parse(version: str) -> tuple:
    """``"1.4.0-rc.2"`` -> ``("1", "4", "0", "rc.2")``."""
    core, _, pre = version.strip().partition("-")
    major, minor, patch = core.split(".")
    return major, minor, patch, pre


def sort_versions(versions: list[str]) -> list[str]:
    """Oldest first, as semver orders them."""
    return sorted(versions, key=parse)


def latest(versions: list[str]) -> str:
    return sort_versions(versions)[-1]
