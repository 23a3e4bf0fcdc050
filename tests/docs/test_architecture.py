"""docs/architecture.md lists every module of the product, and its import diagrams are the code's imports."""

from __future__ import annotations

import re
from pathlib import Path

from tests.schemas.test_layering import PRODUCT, ROOT, import_graph

DOC = ROOT / "docs" / "architecture.md"


def modules(root: Path = ROOT) -> set[str]:
    """Every .py of the product, as a path relative to ``root``."""
    return {str(p.relative_to(root)) for c in PRODUCT for p in (root / c).rglob("*.py")}


def documented(text: str) -> set[str]:
    """The modules the doc names: a backticked path (``polarstream/driver/loop.py``), or a backticked file
    name in a table row that opens with its backticked folder (``| `gateway/` | ... | `app.py` ... |``)."""
    found = set(re.findall(r"`([\w/]+\.py)`", text))
    for row in re.findall(r"^\| `([\w/]+/)` \|(.*)\|$", text, re.M):
        folder, rest = row
        found |= {folder + name for name in re.findall(r"`(\w+\.py)`", rest)}
    return {f for f in found if f.split("/")[0] in PRODUCT}


def test_every_module_of_the_product_is_in_the_architecture_doc_and_every_one_listed_is_there():
    have, listed = modules(), documented(DOC.read_text())
    assert not have - listed, f"not in docs/architecture.md: {sorted(have - listed)}"
    assert not listed - have, f"in docs/architecture.md, but gone: {sorted(listed - have)}"


def _node(module: str) -> str:
    """A module's node in the diagrams: a driver module by its name, else its package (polarstream/'s
    top-level modules are the CLI; its driver, demo, tools and viewer are packages of their own)."""
    parts = module.split(".")
    if parts[0] != "polarstream":
        return parts[0]
    if parts[1:2] == ["driver"]:
        return parts[2] if len(parts) > 2 else "driver"
    return parts[1] if len(parts) > 1 and parts[1] in ("demo", "tools", "viewer") else "cli"


def drawn(text: str, name: str) -> set[tuple[str, str]]:
    """The ``a --> b`` arrows of the diagram after ``<!-- imports:NAME -->``."""
    block = text.split(f"<!-- imports:{name} -->", 1)[1].split("<!-- /imports -->", 1)[0]
    return set(re.findall(r"^\s*(\w+) --> (\w+)\s*$", block, re.M))


FLOOR = {"schemas", "infra"}  # every package may import them: not drawn


def test_the_package_diagram_is_the_imports_between_packages():
    package = lambda m: "driver" if m.startswith("polarstream.driver") else _node(m)  # noqa: E731
    edges = {(package(m), package(d)) for m, deps in import_graph().items() for d in deps}
    want = {(a, b) for a, b in edges if a != b and b not in FLOOR}
    assert drawn(DOC.read_text(), "packages") == want


def test_the_driver_diagram_is_the_imports_of_its_modules():
    """Every import into or out of a driver module, less those into config.py, processes.py and the floor,
    and __init__.py's re-exports (the doc says why)."""
    driver = lambda m: m.startswith("polarstream.driver.")  # noqa: E731
    want = {(_node(m), _node(d)) for m, deps in import_graph().items() if m != "polarstream.driver" for d in deps
            if (driver(m) or driver(d)) and _node(d) not in FLOOR | {"config", "processes"} and _node(m) != _node(d)}
    assert drawn(DOC.read_text(), "driver") == want
