"""Data flows one way and components share only schemas/ (and infra/, producers/' Kafka readers): no
component imports the CLI, driver and demo package (polarstream/), which imports them, the gateway and the
trainer do not import the engine, producers do not import the gateway, streams do not import producers,
no module outside polarstream/demo/ but the CLI imports the demo (the driver takes it as a preset), and
no module of the product ties itself into an import circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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


# Imports a component may not make (function-level ones included): the gateway and the trainer reach the
# engine over HTTP only, and what they share with it at run time (model names, tokenizers) is in infra/,
# which imports no component. The session-key codec that the rollout producer mints with and the gateway
# verifies with is schemas/session_keys.py, so producers need nothing of the gateway; the streams' test
# helpers (the only reason streams imported producers) are tests/streams/helpers.py (issue 61).
FORBIDDEN = {"gateway": {"engine"}, "trainer": {"engine"}, "infra": set(COMPONENTS) - {"schemas", "infra"},
             "producers": {"gateway"}, "streams": {"producers"}}


@pytest.mark.parametrize("component", sorted(FORBIDDEN))
def test_forbidden_imports(component):
    found = [f"{p.relative_to(ROOT)}: {m}" for p in sorted((ROOT / component).rglob("*.py"))
             for m in imports(p) if m.split(".")[0] in FORBIDDEN[component]]
    assert not found, found


def module_imports(path: Path, root: Path = ROOT) -> set[str]:
    """The modules ``path`` (a module of the product under ``root``) imports, relative imports resolved,
    function-level and TYPE_CHECKING ones included: a circle through any of them still ties the two
    modules together."""
    package = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
    if path.name != "__init__.py":  # a package's __init__ is its own package; a module's is its folder's
        package = package.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            out.add(module)
            out |= {f"{module}.{a.name}" for a in node.names}  # `from . import arith` imports a module
    return out


# Everything that ships: the components and the CLI and demo package over them.
PRODUCT = (*COMPONENTS, "polarstream")


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the product modules it imports (``module_imports``), for every module of PRODUCT."""
    modules = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
               for c in PRODUCT for p in (root / c).rglob("*.py")}
    return {m: {i for i in module_imports(p, root) if i in modules and i != m} for m, p in modules.items()}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """A circle (``[a, b, ..., a]``) through each module that is on one, less those whose modules an
    earlier circle already holds."""
    def circle(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    found: dict[frozenset, list[str]] = {}
    for m in sorted(graph):
        if (c := circle(m)) and not any(set(c) <= set(k) for k in found):
            found[frozenset(c)] = c
    return list(found.values())


def test_the_product_has_no_import_circles():
    """No import circle anywhere in the product, function-level and TYPE_CHECKING imports included. Once
    there were: polarstream/'s demo <-> report and learning <-> shape (one direction each now: the CLI ->
    polarstream/driver/ <- the demo); infra/'s nine modules tied to Settings, whose validator found clusters
    on disk (now the leaf infra/discovery.py); streams' group_agent <-> metrics (the table names are
    refresh()'s parameters now)."""
    circles = import_circles(import_graph())
    assert not circles, circles


# The CLI: the entry points and the registry of presets an experiment file names (train: builtin:arith)
CLI = ("polarstream/cli.py", "polarstream/demo_cli.py", "polarstream/presets.py")


def demo_importers(root: Path = ROOT) -> list[str]:
    """Each product module outside polarstream/demo/ that imports polarstream.demo (function-level imports
    included), as ``path: module``."""
    demo = root / "polarstream" / "demo"
    return sorted(f"{p.relative_to(root)}: {m}" for c in PRODUCT for p in (root / c).rglob("*.py") if demo not in p.parents
                  for m in module_imports(p, root) if m == "polarstream.demo" or m.startswith("polarstream.demo."))


def test_only_the_cli_imports_the_demo():
    """The driver runs any preset and imports none: the demo hands it its tasks and hooks through the CLI's
    registry (issue 61). Fails on the code before, where polarstream/loop.py and polarstream/run.py
    imported the arith family, its model, its shape and its capture."""
    found = [f for f in demo_importers() if f.split(":")[0] not in CLI]
    assert not found, found


def test_the_demo_stands_on_the_driver():
    """polarstream/demo/ uses only the driver from the rest of polarstream/ (its config, preset and
    processes), never the CLI."""
    demo = ROOT / "polarstream" / "demo"
    outward = sorted({m for p in demo.rglob("*.py") for m in module_imports(p)
                      if m.startswith("polarstream.") and not m.startswith(("polarstream.demo", "polarstream.driver"))})
    assert not outward, outward
