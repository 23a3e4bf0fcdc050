"""Read docs/benchmarks.md back: its tables as cells, and the JSON leaves they must show.

Written independently of bench/render.py's table builder, so the tests check the page against the
JSON rather than the renderer against itself.
"""

from __future__ import annotations

import re


def cells(line: str) -> list[str]:
    """The cells of one markdown table row (``\\|`` is a literal pipe)."""
    parts = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [p.strip().replace("\\|", "|") for p in parts]


def section(md: str, heading: str) -> str:
    """The text under ``heading`` (a full heading line) up to the next heading of the same or higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = md.splitlines()
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines))
                if lines[i].startswith("#") and len(lines[i]) - len(lines[i].lstrip("#")) <= level), len(lines))
    return "\n".join(lines[start:end])


def tables(md: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of every table; the title is a `code` line just above it, or ""."""
    out, lines, i = [], md.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            title = ""
            j = i - 1
            while j >= 0 and not lines[j].strip():
                j -= 1
            if j >= 0 and re.fullmatch(r"`[^`]+`", lines[j].strip()):
                title = lines[j].strip().strip("`")
            header, rows, i = cells(lines[i]), [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(cells(lines[i]))
                i += 1
            out.append((title, header, rows))
        else:
            i += 1
    return out


def shown_values(md: str) -> dict[str, str]:
    """dotted.path -> cell for every value in the section's key/value and matrix tables."""
    shown = {}
    for title, header, rows in tables(md):
        if header == ["key", "value"]:
            shown.update({r[0]: r[1] for r in rows})
            continue
        for r in rows:
            for col, cell in zip(header[1:], r[1:]):
                shown[".".join(p for p in (title, r[0], col) if p)] = cell
    return shown


def number(cell: str) -> float:
    return float(cell.replace(",", ""))


def close(cell: str, value: float) -> bool:
    """Does the rounded cell show ``value``? Cells keep 3-4 significant digits."""
    return abs(number(cell) - value) <= max(0.006, 0.006 * abs(value))
