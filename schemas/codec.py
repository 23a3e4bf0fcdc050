"""Codec for records: bytes on the wire (JSON, or packed: schemas/packed.py), one clear error for anything malformed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar, get_args

import orjson
from pydantic import BaseModel, ValidationError

from .packed import PackedError, Slot, is_packed, pack, read, unpack
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


def encode(record: Record, encoded: Iterable[tuple[Record, bytes]] = (), *, packed: bool = False) -> bytes:
    """The record's bytes: JSON, or with ``packed`` its token ids, masks and logprobs as binary arrays
    (schemas/packed.py; a record without any stays JSON). ``encoded`` pairs records nested in it with
    what ``encode`` gave for them: those are written as these bytes, not serialized again (a group's
    members, sent as trajectories just before, were a tenth of a streams worker's CPU). Pairs of
    records not inside, or in the other encoding, are ignored."""
    if packed:
        try:
            data = pack(record, encoded, default=_fields)
        except orjson.JSONEncodeError as e:
            _too_deep_to_write(e)
        if data is not None:
            return data
    # orjson walks the records' fields itself: the same bytes as orjson.dumps(model_dump(mode="json"))
    # (tests/schemas/test_codec.py) without copying every token list into a new one first, and a list of
    # ids is written at C speed (pydantic's own to_json takes 4x as long on them). Records hold only JSON
    # types and nested models (no aliases, exclusions or custom serializers), so a model's fields are its
    # JSON object.
    known = {id(r): data for r, data in encoded if not is_packed(data)}  # by identity: the pairs keep each record alive meanwhile
    default = _fields if not known else lambda v: orjson.Fragment(known[id(v)]) if id(v) in known else _fields(v)
    try:
        return orjson.dumps(record, default=default)
    except orjson.JSONEncodeError as e:
        _too_deep_to_write(e)


def _too_deep_to_write(e: orjson.JSONEncodeError):
    if "Recursion limit" in str(e):  # orjson writes at most 254 levels
        raise ValueError("maximum serialization depth exceeded: nested too deep to write as JSON") from None
    raise e


def _fields(value: object) -> dict:
    if isinstance(value, BaseModel):
        return value.__dict__
    raise TypeError(f"{type(value).__name__} is not a JSON type")


def decode(data: bytes | str, cls: type[R]) -> R:
    """Decode ``data`` (either encoding) as a ``cls`` record or raise RecordDecodeError naming the bad field."""
    if is_packed(data):
        return _decode_packed(data, cls)
    # The usual case in one pass: pydantic-core parses and validates the JSON text itself, a third
    # faster than orjson.loads then model_validate. A payload with enough brackets to nest past the
    # limit, or one that fails, takes the checked path below, whose errors name the field.
    if _brackets(data) <= MAX_DEPTH and (record := _one_pass(cls.model_validate_json, data)) is not None:
        return record
    return _decode_checked(data, cls)


def _one_pass(validate, payload) -> Record | None:
    """The record when ``validate`` accepts it at this build's schema version, else None (the checked
    path then says why). Both encodings go through it, so they accept the same records."""
    try:
        record = validate(payload)
    except ValidationError:
        return None
    return record if record.schema_version == SCHEMA_VERSION else None


def _decode_packed(data: bytes, cls: type[R]) -> R:
    try:
        obj, header, slots = read(data)
    except PackedError as e:
        raise RecordDecodeError(cls.__name__, "", f"not a valid packed record ({e})") from None
    brackets = _brackets(header)
    if brackets <= MAX_DEPTH and (record := _arrays_aside(cls, obj, slots)) is not None:
        return record
    for slot in slots:
        slot.fill()
    if brackets <= MAX_DEPTH and (record := _one_pass(cls.model_validate, obj)) is not None:
        return record
    return _validated(obj, brackets, cls)


def _arrays_aside(cls: type[R], obj: dict, slots: list[Slot]) -> R | None:
    """The record validated with its arrays as empty lists, then given them: what ``model_validate`` of
    the whole object returns, without pydantic checking their elements one by one (two thirds of a
    call's validation, most of a trajectory's). The arrays came from typed buffers: their elements are
    checked on their bytes instead (Slot.valid_elements), and the model validators of every model on
    their paths run again with them in place. None when anything does not hold; the caller then
    validates the whole object."""
    if not _arrays_checkable(cls):
        return None
    for slot in slots:
        if not slot.valid_elements():
            return None
    record = _one_pass(cls.model_validate, obj)
    if record is None:
        return None
    touched: dict[int, BaseModel] = {}
    try:
        for slot in slots:
            node: object = record
            if "." in slot.path:  # a nested model's array: every model on the way validates again
                *steps, _ = slot.path.split(".")
                chain = [record]
                for step in steps:
                    node = node[int(step)] if step.isdigit() else getattr(node, step)
                    if isinstance(node, BaseModel):
                        chain.append(node)
                for model in reversed(chain):  # inner models first, as pydantic validates them
                    touched.setdefault(id(model), model)
            else:
                touched.setdefault(id(record), record)
            node.__dict__[slot.name] = slot.values()
        for model in touched.values():
            for validator in _after_validators(type(model)):
                if validator(model) is not model:  # one that returns another model: let pydantic run it
                    return None
    except (ValueError, AssertionError, AttributeError, IndexError, TypeError):
        return None
    return record


_CHECKABLE: dict[type, bool] = {}
_AFTER: dict[type, list] = {}


def _after_validators(model: type[BaseModel]) -> list:
    found = _AFTER.get(model)
    if found is None:
        found = _AFTER[model] = [d.func for d in model.__pydantic_decorators__.model_validators.values()
                                 if d.info.mode == "after"]
    return found


def _models_in(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _arrays_checkable(cls: type) -> bool:
    """Whether ``_arrays_aside`` gives what validating the whole record gives, for records of ``cls``:
    no model on the way to an array has a field validator or a model validator that runs before the
    fields (it would see the empty lists); "after" ones are run again with the arrays in place."""
    ok = _CHECKABLE.get(cls)
    if ok is None:
        seen, todo = set(), [cls]
        ok = True
        while todo:
            model = todo.pop()
            if model in seen:
                continue
            seen.add(model)
            decorators = model.__pydantic_decorators__
            if decorators.field_validators or decorators.validators or decorators.root_validators or any(
                    d.info.mode != "after" for d in decorators.model_validators.values()):
                ok = False
            todo.extend(m for field in model.model_fields.values() for m in _models_in(field.annotation))
        ok = _CHECKABLE[cls] = ok
    return ok


def _decode_checked(data: bytes | str, cls: type[R]) -> R:
    name = cls.__name__
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise RecordDecodeError(name, "", f"not valid JSON ({e})") from None
    return _validated(obj, _brackets(data), cls)


def document(data: bytes) -> object:
    """The record's JSON object as it was written, arrays in place, not validated (for tools that
    rewrite records of any version: polarstream forget). Raises ValueError when it is neither encoding."""
    return unpack(data)[0] if is_packed(data) else orjson.loads(data)


def _validated(obj: object, brackets: int, cls: type[R]) -> R:
    name = cls.__name__
    if not isinstance(obj, dict):
        raise RecordDecodeError(name, "", f"expected a JSON object, got {type(obj).__name__}")
    if brackets > MAX_DEPTH and _too_deep(obj, MAX_DEPTH):
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
