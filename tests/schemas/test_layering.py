"""Data flows one way and components share only schemas/ (and infra/, producers/' Kafka readers): no
component imports the CLI and demo package (polarstream/), which imports them, the gateway and the
trainer do not import the engine, producers do not import the gateway, streams do not import producers,
and no module of the product ties itself into an import circle."""

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
    package = ".".join(path.relative_to(root).with_suffix("").parts)
    if path.name != "__init__.py":
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
    there were: polarstream/'s demo <-> report and learning <-> shape (one direction each now: cli -> run
    -> loop -> report -> config, loop -> demo); infra/'s nine modules tied to Settings, whose validator
    found clusters on disk (now the leaf infra/discovery.py); streams' group_agent <-> metrics (the table
    names are refresh()'s parameters now)."""
    circles = import_circles(import_graph())
    assert not circles, circles


def test_the_demo_package_stands_on_the_loop_not_the_reverse():
    """polarstream/demo/ (the arith family, its warm start, capture and shape) uses only the run's config
    and processes from the rest of polarstream/; only the loop (its arith defaults) and the CLI import it."""
    demo = ROOT / "polarstream" / "demo"
    outward = sorted({m for p in demo.rglob("*.py") for m in module_imports(p)
                      if m.startswith("polarstream.") and not m.startswith("polarstream.demo")})
    assert set(outward) <= {"polarstream.config", "polarstream.config.RunConfig", "polarstream.processes",
                            "polarstream.processes.Processes", "polarstream.processes.ProcessFailed"}, outward
    users = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "polarstream").rglob("*.py") if demo not in p.parents
                   and any(m.startswith("polarstream.demo") for m in module_imports(p)))
    assert users == ["polarstream/demo_cli.py", "polarstream/loop.py", "polarstream/run.py"], users
