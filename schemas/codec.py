"""orjson codec for records: bytes on the wire, one clear error for anything malformed."""

from __future__ import annotations

from typing import TypeVar

import orjson
from pydantic import ValidationError

from .records import SCHEMA_VERSION, Record

R = TypeVar("R", bound=Record)
# Deeper payloads are refused: pydantic cannot serialize ~250 levels and orjson encodes at most 254, so a
# deeper record would decode here but fail when a consumer re-publishes it (found by tests/fuzz).
MAX_DEPTH = 128


class RecordDecodeError(ValueError):
    """A payload that is not a valid record of the expected type; the message names the field."""

    def __init__(self, record_type: str, field: str, problem: str):
        self.record_type, self.field, self.problem = record_type, field, problem
        super().__init__(f"{record_type}.{field}: {problem}" if field else f"{record_type}: {problem}")


def encode(record: Record) -> bytes:
    return orjson.dumps(record.model_dump(mode="json"))


def decode(data: bytes | str, cls: type[R]) -> R:
    """Decode ``data`` as a ``cls`` record or raise RecordDecodeError naming the bad field."""
    name = cls.__name__
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise RecordDecodeError(name, "", f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise RecordDecodeError(name, "", f"expected a JSON object, got {type(obj).__name__}")
    if _brackets(data) > MAX_DEPTH and _too_deep(obj, MAX_DEPTH):
        raise RecordDecodeError(name, "", f"nested deeper than {MAX_DEPTH} levels")
    version = obj.get("schema_version")
    if version != SCHEMA_VERSION:
        raise RecordDecodeError(name, "schema_version", f"unsupported version {version!r} (this build reads {SCHEMA_VERSION})")
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = ".".join(str(p) for p in err["loc"])
        raise RecordDecodeError(name, field, err["msg"]) from None


def _brackets(data: bytes | str) -> int:
    """How many containers the JSON text opens at most (brackets inside strings count too): a record
    that opens no more than the limit cannot nest deeper, and token lists open one each, so the walk
    below is skipped for nearly every record (it was a fifth of a streams worker's CPU)."""
    return data.count(b"[") + data.count(b"{") if isinstance(data, bytes) else data.count("[") + data.count("{")


def _too_deep(value: object, limit: int) -> bool:
    """Whether a decoded JSON value nests more than ``limit`` containers (iterative: deep input cannot recurse)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if type(node) is dict else node
        kinds = set(map(type, children))  # at C speed: a list of 15k token ids is not walked one by one
        if dict in kinds or list in kinds:
            stack.extend((c, depth + 1) for c in children if type(c) is dict or type(c) is list)
    return False
