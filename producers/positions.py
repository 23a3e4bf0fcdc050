"""Where a tool starts and stops reading: times and offset files, parsed with errors that name the input.

Offsets use the project's convention for stored positions (the trainer's checkpoints use it too):
``{logical topic: {partition: next offset to read}}``, e.g. ``{"calls": {"0": 120, "1": 98}}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import orjson

Offsets = dict[str, dict[int, int]]


class PositionError(ValueError):
    """A start/stop position that cannot be used; the message names the input and what is wrong."""


@dataclass(frozen=True)
class Span:
    """Offsets ``[start, end)`` of one partition of a logical topic ("calls")."""

    topic: str
    partition: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return max(0, self.end - self.start)


def parse_time(text: str) -> int:
    """Milliseconds since the epoch for ``text``: unix seconds (``1764410400.5``) or ISO 8601
    (``2026-11-29T10:00:00Z``; without a zone it is UTC, so the same text means the same instant
    on every machine)."""
    text = text.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise PositionError(f"time {text!r}: expected unix seconds or ISO 8601 like 2026-11-29T10:00:00Z") from None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=timezone.utc)
        seconds = dt.timestamp()
    if not math.isfinite(seconds) or seconds < 0:
        raise PositionError(f"time {text!r}: must be a non-negative instant")
    return int(round(seconds * 1000))


def parse_offsets(data: object, topics: tuple[str, ...], source: str = "offsets") -> Offsets:
    """Validate an offsets document (already JSON-decoded) for ``topics`` (logical names).

    Topic keys may carry the ``polar.`` prefix; partitions are strings or ints; offsets are
    non-negative ints. A topic the document does not name is read from its beginning.
    """
    if not isinstance(data, dict):
        raise PositionError(f"{source}: expected an object {{topic: {{partition: offset}}}}, got {type(data).__name__}")
    out: Offsets = {}
    for topic, parts in data.items():
        name = str(topic).removeprefix("polar.")
        if name not in topics:
            raise PositionError(f"{source}: topic {topic!r} is not one of {', '.join(topics)}")
        if not isinstance(parts, dict):
            raise PositionError(f"{source}.{topic}: expected {{partition: offset}}, got {type(parts).__name__}")
        out[name] = {}
        for p, o in parts.items():
            try:
                partition = int(p)
            except (TypeError, ValueError):
                raise PositionError(f"{source}.{topic}: partition {p!r} is not an integer") from None
            if isinstance(o, bool) or not isinstance(o, int) or o < 0 or partition < 0:
                raise PositionError(f"{source}.{topic}.{p}: offset {o!r} must be a non-negative integer")
            out[name][partition] = o
    return out


def load_offsets(path: Path, topics: tuple[str, ...]) -> Offsets:
    """``parse_offsets`` of a JSON file; a missing or malformed file is a PositionError naming it."""
    try:
        data = orjson.loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise PositionError(f"{path}: no such offsets file") from None
    except orjson.JSONDecodeError as e:
        raise PositionError(f"{path}: not valid JSON ({e})") from None
    return parse_offsets(data, topics, str(path))


def offsets_of(spans: list[Span], which: str = "end") -> dict[str, dict[str, int]]:
    """Spans as an offsets document (JSON-ready): where they ``start`` or ``end``."""
    out: dict[str, dict[str, int]] = {}
    for s in spans:
        out.setdefault(s.topic, {})[str(s.partition)] = s.start if which == "start" else s.end
    return out
