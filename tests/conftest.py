"""Test-wide fixtures live in tests/plugins/<component>.py, one file per owner, loaded here."""

from pathlib import Path

pytest_plugins = sorted(
    f"tests.plugins.{p.stem}" for p in (Path(__file__).parent / "plugins").glob("*.py") if p.stem != "__init__"
)
