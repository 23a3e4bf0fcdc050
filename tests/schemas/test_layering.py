"""Data flows one way and components share only schemas/ (and infra/, producers/' Kafka readers): no
component imports the CLI and demo package (polarstream/), which imports them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2]
COMPONENTS = ("schemas", "infra", "producers", "gateway", "streams", "trainer", "engine")


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def test_no_component_imports_polarstream():
    found = [f"{p.relative_to(ROOT)}: {m}" for c in COMPONENTS for p in sorted((ROOT / c).rglob("*.py"))
             for m in imports(p) if m == "polarstream" or m.startswith("polarstream.")]
    assert not found, found


def test_schemas_import_no_component():
    found = [f"{p.relative_to(ROOT)}: {m}" for p in sorted((ROOT / "schemas").rglob("*.py"))
             for m in imports(p) if m.split(".")[0] in set(COMPONENTS) - {"schemas"} | {"polarstream"}]
    assert not found, found
