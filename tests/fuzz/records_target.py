"""Coverage-guided fuzzing (atheris / libFuzzer) of the record decoders and the prompt-delta resolver.

    .venv/bin/python -m tests.fuzz.records_target [-runs=N | -max_total_time=S] [corpus dirs...]

One input drives one of three checks (the first byte picks):

- ``decode``: the rest is a payload for ``schemas.codec.decode`` as one record type. It must decode or
  raise ``RecordDecodeError``; a record that decodes must re-encode and decode to itself, and hold
  together (``consistent``).
- ``mutate``: a valid sample record with one field set to a fuzzed JSON value (reaches the validators
  that raw bytes rarely get to), decoded as JSON and as a packed container (schemas/packed.py) with the
  same content: both must decode to the same record or both be refused. Then the packed bytes of the
  sample cut short or with one byte changed: refused with RecordDecodeError, or a consistent record.
- ``delta``: random prompt / base sequences through ``encode_prompt`` and ``resolve_prompt``: the
  resolved prompt is the original exactly; a delta whose base is missing or too short raises DeltaError.

Anything else (another exception, a silently wrong result) is a crash: libFuzzer saves the input as
``crash-*``. Save those under tests/fuzz/regressions/records/ and test_records_fuzz.py replays them.
"""

from __future__ import annotations

if __name__ == "__main__":  # coverage feedback from our own code only: instrumenting all of pydantic takes minutes
    import atheris

    with atheris.instrument_imports(include=["schemas"]):
        import schemas  # noqa: F401

import math
import sys
from typing import Any

import orjson

from schemas import RECORD_TYPES, CallRecorded, Trace, TrainingGroup, Trajectory
from schemas.codec import RecordDecodeError, decode, encode
from schemas.delta import DeltaError, encode_prompt, resolve_prompt
from schemas.packed import FIELD_DTYPES, MAGIC
from tests.fuzz.json_paths import paths

TYPES = sorted(RECORD_TYPES)
FIELD_OWNERS = ("CallRecorded", "Trajectory", "TrainingGroup")  # the records that hold packed arrays


class Inconsistent(AssertionError):
    """A record that passed validation but does not hold together."""


def consistent(record: Any) -> None:
    """Cross-field invariants every decoded record must keep (what the validators promise)."""
    if isinstance(record, CallRecorded):
        ids = [*(record.prompt_ids or []), *record.completion_ids, *(record.prompt_delta.suffix_ids if record.prompt_delta else [])]
        if (record.prompt_ids is None) == (record.prompt_delta is None):
            raise Inconsistent("prompt_ids and prompt_delta both set or both absent")
        if len(record.completion_logprobs) != len(record.completion_ids):
            raise Inconsistent("logprobs and completion ids differ in length")
        if any(i < 0 for i in ids):
            raise Inconsistent("negative token id")
        if not all(math.isfinite(x) for x in record.completion_logprobs):
            raise Inconsistent("non-finite logprob")
    traces = [record] if isinstance(record, Trace) else []
    if isinstance(record, Trajectory):
        traces = record.traces
    if isinstance(record, TrainingGroup):
        if len(record.advantages) != len(record.trajectories):
            raise Inconsistent("advantages and trajectories differ in length")
        traces = [t for tr in record.trajectories for t in tr.traces]
    for t in traces:
        if not len(t.token_ids) == len(t.loss_mask) == len(t.logprobs):
            raise Inconsistent("trace lengths differ")
        if any(m not in (0, 1) for m in t.loss_mask) or any(i < 0 for i in t.token_ids):
            raise Inconsistent("loss_mask outside {0, 1} or negative token id")
        if not all(math.isfinite(x) for x in t.logprobs):
            raise Inconsistent("non-finite trace logprob")


def check_decode(payload: bytes, type_name: str) -> None:
    """``payload`` decodes as ``type_name`` or is refused with RecordDecodeError; what decodes round-trips."""
    cls = RECORD_TYPES[type_name]
    try:
        record = decode(payload, cls)
    except RecordDecodeError:
        return
    consistent(record)
    for packed in (False, True):  # a consumer that re-publishes must be able to, in either encoding
        again = decode(encode(record, packed=packed), cls)
        if again != record:
            raise Inconsistent(f"{type_name} does not round-trip (packed={packed}): {record!r} != {again!r}")


def as_container(doc: dict) -> bytes | None:
    """The JSON object with every packable list (by field name, with values its dtype holds) moved into
    a packed container, whether or not the record is valid; None when there is none."""
    import struct

    entries, blobs = [], []
    codes = {"<i4": ("i", lambda v: type(v) is int and -2**31 <= v < 2**31),
             "|u1": ("B", lambda v: type(v) is int and 0 <= v < 256),
             "<f8": ("d", lambda v: type(v) in (int, float))}

    def walk(node, path):
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in list(items):
            if isinstance(node, dict) and k in FIELD_DTYPES and isinstance(v, list) and v:
                dtype = "<f8" if FIELD_DTYPES[k] == "<f4" else FIELD_DTYPES[k]
                code, fits = codes[dtype]
                if all(map(fits, v)):
                    entries.append([".".join(map(str, (*path, k))), dtype, len(v)])
                    blobs.append(struct.pack(f"<{len(v)}{code}", *v))
                    node[k] = None
                    continue
            walk(v, (*path, k))

    walk(doc, ())
    if not entries:
        return None
    head = orjson.dumps({"record": doc, "arrays": entries})
    return MAGIC + struct.pack("<I", len(head)) + head + b"".join(blobs)


def check_agree(plain: bytes, packed: bytes, type_name: str) -> None:
    """The same content in both encodings: the same record, or refused by both."""
    cls = RECORD_TYPES[type_name]
    got = []
    for payload in (plain, packed):
        try:
            got.append(decode(payload, cls))
        except RecordDecodeError:
            got.append(None)
    if got[0] != got[1]:
        raise Inconsistent(f"{type_name}: JSON and packed decode differently: {got[0]!r} != {got[1]!r}")


def samples() -> list[dict[str, Any]]:
    """One valid record of each type as JSON objects (the structured mode's starting points)."""
    from tests.schemas.samples import sample_records

    return [orjson.loads(encode(r)) | {"__type__": type(r).__name__} for r in sample_records()]


_SAMPLES: list[dict[str, Any]] = []
_PACKED: list[tuple[bytes, str]] = []


def fuzzed_json(fdp: Any, depth: int = 0) -> Any:
    """A JSON value drawn from the fuzzer's bytes (small, with the numbers and strings that break things)."""
    kind = fdp.ConsumeIntInRange(0, 9 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeInt(8)
    if kind == 3:
        return fdp.PickValueInList([0.0, -0.0, 1e308, -1e308, 5e-324, 0.5, -1.0, 1.5, 2.0**63, -(2.0**63)])
    if kind == 4:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 12))
    if kind == 5:
        return fdp.PickValueInList(["NaN", "inf", "-Infinity", "1e999", "0x10", " 1 ", "", "true"])
    if kind in (6, 7):
        return [fuzzed_json(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    return {fdp.ConsumeUnicodeNoSurrogates(6): fuzzed_json(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3))}


def check_mutation(fdp: Any) -> None:
    """A valid sample with one location replaced by a fuzzed value, decoded as its own type."""
    if not _SAMPLES:
        _SAMPLES.extend(samples())
    doc = orjson.loads(orjson.dumps(fdp.PickValueInList(_SAMPLES)))
    type_name = doc.pop("__type__")
    where = fdp.PickValueInList(paths(doc)[1:])
    node = doc
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = fuzzed_json(fdp)
    plain = orjson.dumps(doc)
    check_decode(plain, type_name)
    packed = as_container(orjson.loads(plain))
    if packed is not None:
        check_decode(packed, type_name)
        check_agree(plain, packed, type_name)
    check_damaged(fdp)


def check_damaged(fdp: Any) -> None:
    """A sample's packed bytes cut short or with one byte changed."""
    if not _PACKED:
        from tests.schemas.samples import sample_records

        _PACKED.extend((encode(r, packed=True), type(r).__name__) for r in sample_records() if type(r).__name__ in FIELD_OWNERS)
    data, type_name = fdp.PickValueInList(_PACKED)
    at = fdp.ConsumeIntInRange(0, len(data) - 1)
    damaged = data[:at] if fdp.ConsumeBool() else data[:at] + bytes([fdp.ConsumeIntInRange(0, 255)]) + data[at + 1:]
    check_decode(damaged, type_name)


def check_delta(fdp: Any) -> None:
    """encode_prompt then resolve_prompt gives the prompt back; a broken reference raises DeltaError."""
    vocab = fdp.ConsumeIntInRange(1, 6)
    base = [fdp.ConsumeIntInRange(0, vocab) for _ in range(fdp.ConsumeIntInRange(0, 40))]
    keep = fdp.ConsumeIntInRange(0, len(base))
    prompt = base[:keep] + [fdp.ConsumeIntInRange(0, vocab) for _ in range(fdp.ConsumeIntInRange(0, 20))]
    delta = encode_prompt(prompt, 0, base)
    if delta is None:
        if prompt and base and prompt[0] == base[0]:
            raise Inconsistent("a shared prefix was not encoded")
        return
    if delta.base_len > len(base) or base[: delta.base_len] != prompt[: delta.base_len]:
        raise Inconsistent(f"delta {delta} does not describe a prefix of the base")
    call = CallRecorded(session_id="s", call_index=1, provider="engine", prompt_delta=delta)
    if resolve_prompt(call, {0: base}) != prompt:
        raise Inconsistent("resolved prompt differs from the encoded one")
    cut = fdp.ConsumeIntInRange(0, len(base))
    try:
        got = resolve_prompt(call, {0: base[:cut]} if fdp.ConsumeBool() else {})
    except DeltaError:
        return
    if got != prompt:
        raise Inconsistent("a truncated base resolved to a different prompt without an error")


def check_one(data: bytes) -> None:
    """One fuzz input (see the module docstring); raises on a finding."""
    import atheris

    fdp = atheris.FuzzedDataProvider(data)
    mode = fdp.ConsumeIntInRange(0, 2)
    if mode == 0:
        type_name = fdp.PickValueInList(TYPES)
        check_decode(fdp.ConsumeBytes(fdp.remaining_bytes()), type_name)
    elif mode == 1:
        check_mutation(fdp)
    else:
        check_delta(fdp)


def main() -> None:
    import atheris

    atheris.Setup(sys.argv, check_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
