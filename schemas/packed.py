"""Packed records: token ids, loss masks and logprobs as raw little-endian arrays, everything else JSON.

A token id as JSON text is about 7 bytes and costs a parse; packed it is 4 bytes and a memcpy. The
container is simple enough to read in any language (docs/events.md has a stdlib-only reader):

    b"PSR1" | header length (uint32 LE) | header (UTF-8 JSON) | the arrays, back to back

    header = {"record": <the record as JSON, each packed list written as null>,
              "arrays": [[path, dtype, count], ...]}        # in the order their bytes follow

``path`` names the list from the record's root, field names and list indices joined by dots
("traces.0.token_ids"); ``dtype`` is a numpy-style code: "<i4" (token ids), "|u1" (loss masks), "<f4"
(logprobs; "<f8" for a list that float32 cannot hold exactly). Only the named fields of the records'
own models are packed, so a call's free-form ``request`` stays JSON and no harness content can pose as
an array; an empty list stays JSON, and a record without arrays (a task, a session event) is plain JSON.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import numpy as np
import orjson
from pydantic import BaseModel

from .records import CallRecorded, PromptDelta, Record, Trace, TrainingGroup, Trajectory

MAGIC = b"PSR1"
_LENGTH = struct.Struct("<I")
_START = len(MAGIC) + _LENGTH.size
# The packed lists, by the model that holds them, with their dtype.
ARRAYS: dict[type, dict[str, str]] = {
    CallRecorded: {"prompt_ids": "<i4", "completion_ids": "<i4", "completion_logprobs": "<f4"},
    PromptDelta: {"suffix_ids": "<i4"},
    Trace: {"token_ids": "<i4", "loss_mask": "|u1", "logprobs": "<f4", "token_advantages": "<f4"},
}
# The dtype each packed field is written in, by field name (a float field also takes "<f8": exact values).
FIELD_DTYPES: dict[str, str] = {name: dtype for fields in ARRAYS.values() for name, dtype in fields.items()}
PACKED_FIELDS = frozenset(FIELD_DTYPES)
# The fields through which records nest the models above.
_NESTED: dict[type, tuple[str, ...]] = {CallRecorded: ("prompt_delta",), Trajectory: ("traces",),
                                        TrainingGroup: ("trajectories",)}
PACKABLE = (CallRecorded, Trajectory, TrainingGroup)
_ITEMSIZE = {"<i4": 4, "|u1": 1, "<f4": 4, "<f8": 8}  # numpy reads each as little-endian on any machine
# The most a level of nesting adds to one array's entry in the header ("trajectories.1023." and the
# like): how the parts of a split record are sized before they are nested (schemas/parts.py).
NESTING_BYTES_PER_ARRAY = 32


class PackedError(ValueError):
    """A packed container that is malformed; the message says where."""


def is_packed(data: bytes | str) -> bool:
    return isinstance(data, (bytes, bytearray, memoryview)) and bytes(data[:4]) == MAGIC


def pack(record: BaseModel, encoded: Iterable[tuple[Record, bytes]] = (), default=None) -> bytes | None:
    """The record as a packed container, or None when it holds no array to pack (it stays JSON).
    ``encoded``: records nested in it with their packed bytes, spliced in rather than packed again."""
    if not isinstance(record, (*PACKABLE, Trace)):
        return None
    known = {id(r): data for r, data in encoded if is_packed(data)}
    entries: list[list] = []
    blobs: list[bytes] = []

    def walk(model: BaseModel, prefix: str) -> dict:
        fields = dict(model.__dict__)
        for name, dtype in ARRAYS.get(type(model), {}).items():
            values = fields[name]
            if values:
                dtype, blob = _to_bytes(values, dtype, prefix + name)
                entries.append([prefix + name, dtype, len(values)])
                blobs.append(blob)
                fields[name] = None
        for name in _NESTED.get(type(model), ()):
            value = fields[name]
            if isinstance(value, list):
                fields[name] = [nested(v, f"{prefix}{name}.{i}.") for i, v in enumerate(value)]
            elif value is not None:
                fields[name] = nested(value, f"{prefix}{name}.")
        return fields

    def nested(model: BaseModel, prefix: str) -> object:
        data = known.get(id(model))
        if data is None:
            return walk(model, prefix)
        head, arrays, body = _parts(data)  # what this process packed: its record's JSON goes in as it is
        entries.extend([prefix + path, dtype, n] for path, dtype, n in arrays)
        blobs.append(body)
        return orjson.Fragment(head)

    fields = walk(record, "")
    if not entries:
        return None
    header = orjson.dumps({"record": fields, "arrays": entries}, default=default)
    return b"".join((MAGIC, _LENGTH.pack(len(header)), header, *blobs))


def _to_bytes(values: list, dtype: str, path: str) -> tuple[str, bytes]:
    # struct, not array(code, values): a third of the time on a list of 15k ids.
    n = len(values)
    try:
        if dtype == "|u1":
            return dtype, bytes(values)
        if dtype == "<i4":
            return dtype, struct.pack(f"<{n}i", *values)
        if n >= _VECTOR_FROM:
            return _float32_or_64(struct.pack(f"<{n}d", *values))
        blob = struct.pack(f"<{n}f", *values)
    except OverflowError:  # a float past float32's range
        return "<f8", struct.pack(f"<{n}d", *values)
    except (struct.error, ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None
    if restore_float32(blob) != values:  # not float32 values at 9 digits: kept exact
        return "<f8", struct.pack(f"<{n}d", *values)
    return dtype, blob


def _float32_or_64(doubles: bytes) -> tuple[str, bytes]:
    """Many floats: as float32 when they all come back exactly from it, else as the float64s given.
    Checked in numpy rather than as lists: a trace has thousands of logprobs."""
    values = np.frombuffer(doubles, "<f8")
    with np.errstate(over="ignore"):  # past float32's range: inf, which then does not compare equal
        singles = values.astype("<f4")
    if np.array_equal(_restored(singles), values):
        return "<f4", singles.tobytes()
    return "<f8", doubles


_DIGITS = "{:.9g}".format  # schemas.float32_digits, without the float
_VECTOR_FROM = 256  # below this many values, formatting them is faster than numpy's fixed cost
_POW10 = np.array([10.0 ** k for k in range(23)])  # exact doubles
_FORMATS: dict[int, str] = {}  # "[%.9g,%.9g,...]" by length (< _VECTOR_FROM): one % for a whole list


def restore_float32(blob: bytes) -> list[float]:
    """Little-endian float32s as the gateway records them: each at the 9 significant digits that give
    back the float32 (schemas.float32_digits), so a packed record decodes equal to its JSON. The
    encoder checks that this gives back every value exactly (else it writes float64), so the few values
    where the fast path's rounding differs from formatting cannot change a record."""
    values = np.frombuffer(blob, "<f4")
    if len(values) < _VECTOR_FROM and values.all():  # a call's logprobs: few, all sampled
        return _formatted(values)
    return _restored(values).tolist()


def _restored(values: np.ndarray) -> np.ndarray:
    """``restore_float32`` as float64s. A trace's logprobs are mostly zeros (its prompt positions),
    exact as they are (-0.0 too): only the others are restored."""
    if len(values) >= _VECTOR_FROM and values.all():  # a long completion: no zeros to keep, no index to copy through
        return _nine_digits(values)
    out = values.astype(np.float64)
    nonzero = np.flatnonzero(values)
    sampled = values[nonzero]
    out[nonzero] = _formatted(sampled) if len(sampled) < _VECTOR_FROM else _nine_digits(sampled)
    return out


def _formatted(values: np.ndarray) -> list[float]:
    widened = values.tolist()
    fmt = _FORMATS.get(len(widened))
    if fmt is None:
        fmt = _FORMATS[len(widened)] = f"[{','.join(['%.9g'] * len(widened))}]"
    try:  # one format and one parse of all the digits: 2.5x as fast as float() on each
        restored = orjson.loads(fmt % tuple(widened))
    except orjson.JSONDecodeError:  # inf or nan: float32 overflowed (the encoder then writes float64)
        return [float(_DIGITS(v)) for v in widened]
    if int in set(map(type, restored)):  # "0", "-0", "2": integral float32s, exact as they are (-0.0 too)
        restored = [v if type(v) is float else w for v, w in zip(restored, widened)]
    return restored


def _nine_digits(values: np.ndarray) -> np.ndarray:
    """``restore_float32`` in bulk: x rounded to an integer of 9 digits after scaling by an exact power
    of ten, then scaled back by one correctly rounded division or product, the same double as parsing
    those digits; values out of that range (or not finite) are formatted one by one."""
    x = values.astype(np.float64)
    mag = np.abs(x)
    ok = np.isfinite(mag) & (mag > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = 8 - np.floor(np.log10(np.where(ok, mag, 1.0))).astype(np.int64)  # 10^k * |x| has 9 digits
    for _ in range(2):  # log10 can be one off next to a power of ten
        scaled = np.where(k >= 0, mag * _POW10[np.clip(k, 0, 22)], mag / _POW10[np.clip(-k, 0, 22)])
        k = np.where(scaled >= 1e9 - 0.5, k - 1, np.where(scaled < 1e8 - 0.5, k + 1, k))
    scaled = np.where(k >= 0, mag * _POW10[np.clip(k, 0, 22)], mag / _POW10[np.clip(-k, 0, 22)])
    digits = np.round(scaled)  # half to even on the scaled value, as the exact one almost always rounds
    back = np.where(k >= 0, digits / _POW10[np.clip(k, 0, 22)], digits * _POW10[np.clip(-k, 0, 22)])
    out = np.where(ok, np.copysign(back, x), x)
    for i in np.flatnonzero(ok & ((k > 22) | (k < -22))).tolist():
        out[i] = float(_DIGITS(float(x[i])))
    return out


def array_count(data: bytes) -> int:
    """How many arrays a record's bytes hold (0 for JSON)."""
    return len(_parts(data)[1]) if is_packed(data) else 0


def _parts(data: bytes) -> tuple[bytes, list, memoryview]:
    """The record's JSON, the array entries and the arrays' bytes of a container this module wrote
    (its header is exactly {"record":...,"arrays":[...]})."""
    (n,) = _LENGTH.unpack_from(data, len(MAGIC))
    header = data[_START:_START + n]
    cut = header.rfind(b',"arrays":[')
    return header[len(b'{"record":'):cut], orjson.loads(header[cut + len(b',"arrays":'):-1]), memoryview(data)[_START + n:]


def unpack(data: bytes) -> tuple[dict, bytes]:
    """The record as a JSON object with its arrays in place, and its header (for a depth check).
    Raises PackedError on a malformed container."""
    obj, header, slots = read(data)
    for slot in slots:
        slot.fill()
    return obj, header


class Slot:
    """Where one array of a container goes: its field, still an empty list in the record's JSON object
    (``node[name]``), and its bytes; ``values()`` are what a JSON record would hold there."""

    __slots__ = ("path", "node", "name", "dtype", "blob")

    def __init__(self, path: str, node: dict, name: str, dtype: str, blob: bytes):
        self.path, self.node, self.name, self.dtype, self.blob = path, node, name, dtype, blob

    def values(self) -> list:
        return restore_float32(self.blob) if self.dtype == "<f4" else np.frombuffer(self.blob, self.dtype).tolist()

    def fill(self) -> None:
        self.node[self.name] = self.values()

    def valid_elements(self) -> bool:
        """Whether every element passes its field's element type: token ids (int32) are not negative,
        a loss mask holds 0 and 1, logprobs are finite. False also when the dtype is not the field's own
        (FIELD_DTYPES; a logprob field takes "<f8" too), which the models then judge. Checked on the
        bytes, at C speed: a sign byte, or the top byte of a float that could hold an all-ones exponent."""
        dtype, blob, expected = self.dtype, self.blob, FIELD_DTYPES[self.name]
        if dtype != expected and not (expected == "<f4" and dtype == "<f8"):
            return False
        if dtype == "<i4":
            return not blob[3::4].translate(None, _BELOW_128)  # every high byte under 0x80
        if dtype == "|u1":
            return not blob.translate(None, b"\x00\x01")
        top = blob[3::4] if dtype == "<f4" else blob[7::8]
        if top.translate(None, _BUT_7F_FF):  # a top byte 0x7F or 0xFF: inf, nan or a huge value; numpy decides
            return bool(np.isfinite(np.frombuffer(blob, dtype)).all())
        return True


_BELOW_128 = bytes(range(128))
_BUT_7F_FF = bytes(b for b in range(256) if b not in (0x7F, 0xFF))


def read(data: bytes) -> tuple[dict, bytes, list[Slot]]:
    """The record's JSON object with an empty list where each array goes, its header, and the arrays'
    slots in the order they were written. Raises PackedError on a malformed container."""
    if len(data) < _START:
        raise PackedError("truncated before the header length")
    (n,) = _LENGTH.unpack_from(data, len(MAGIC))
    if _START + n > len(data):
        raise PackedError(f"header of {n} bytes runs past the end ({len(data)} bytes)")
    header = data[_START:_START + n]
    try:
        head = orjson.loads(header)
    except orjson.JSONDecodeError as e:
        raise PackedError(f"header is not valid JSON ({e})") from None
    if not isinstance(head, dict) or not isinstance(head.get("record"), dict) or not isinstance(head.get("arrays"), list):
        raise PackedError('header must be {"record": {...}, "arrays": [...]}')
    obj, at, slots = head["record"], _START + n, []
    for entry in head["arrays"]:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and entry[1] in _ITEMSIZE and type(entry[2]) is int and entry[2] >= 0):
            raise PackedError(f"array entry {str(entry)[:80]}: expected [path, dtype, count]")
        path, dtype, count = entry
        size = count * _ITEMSIZE[dtype]
        if at + size > len(data):
            raise PackedError(f"{path}: {count} x {dtype} runs past the end")
        node, name = _slot(obj, path)
        slots.append(Slot(path, node, name, dtype, data[at:at + size]))
        at += size
    if at != len(data):
        raise PackedError(f"{len(data) - at} bytes after the last array")
    return obj, header, slots


def _slot(obj: dict, path: str) -> tuple[dict, str]:
    """The object and field name that ``path`` names, which must be a packed field written as null;
    it is set to an empty list (so a second array for the same path is refused)."""
    *steps, name = path.split(".")
    node: object = obj
    for step in steps:
        if isinstance(node, list) and step.isdigit() and int(step) < len(node):
            node = node[int(step)]
        elif isinstance(node, dict) and step in node:
            node = node[step]
        else:
            raise PackedError(f"{path}: no {step!r} in the record")
    if name not in PACKED_FIELDS or not isinstance(node, dict) or node.get(name, 0) is not None:
        raise PackedError(f"{path}: not a packed field written as null")
    node[name] = []
    return node, name
