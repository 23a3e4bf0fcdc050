"""Locations inside a JSON value, for fuzzers that replace one subtree of a valid document.

Dependency-free on purpose: the atheris target (records_target.py) imports it too.
"""

from __future__ import annotations

from typing import Any


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every location inside a JSON value (the root, ``()``, first), as key/index tuples."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, prefix + (i,))
    return out
