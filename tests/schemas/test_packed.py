"""Packed records (schemas/packed.py): the same records as JSON, token arrays as raw little-endian bytes."""

from __future__ import annotations

import struct
from pathlib import Path

import orjson
import pytest

from schemas import (CallRecorded, RecordDecodeError, TaskRequest, Trace, TrainingGroup, Trajectory, decode, document,
                     encode, float32_digits)
from schemas.packed import MAGIC, is_packed, unpack

from .samples import call, sample_records, trajectory


def f32(x: float) -> float:
    return float32_digits(struct.unpack("<f", struct.pack("<f", x))[0])


def container(header: dict | bytes, body: bytes = b"") -> bytes:
    head = header if isinstance(header, bytes) else orjson.dumps(header)
    return MAGIC + struct.pack("<I", len(head)) + head + body


@pytest.mark.parametrize("record", sample_records(), ids=lambda r: type(r).__name__)
def test_every_record_decodes_to_what_its_json_decodes_to(record):
    packed, plain = encode(record, packed=True), encode(record)
    assert decode(packed, type(record)) == decode(plain, type(record)) == record
    assert is_packed(packed) == isinstance(record, (CallRecorded, Trajectory, TrainingGroup))  # the rest stays JSON
    assert document(packed) == orjson.loads(plain)  # the unvalidated view too


def test_token_ids_take_four_bytes_and_the_request_stays_json():
    c = call().model_copy(update={"prompt_ids": list(range(40_000, 50_000)),
                                  "request": {"token_ids": [1, 2], "loss_mask": None}})
    packed = encode(c, packed=True)
    longer = encode(c.model_copy(update={"prompt_ids": list(range(30_000, 50_000))}), packed=True)
    assert len(longer) - len(packed) == 4 * 10_000  # 6 characters an id as JSON, 4 bytes packed
    head, _ = unpack(packed)
    assert head["request"] == {"token_ids": [1, 2], "loss_mask": None}  # a look-alike in free-form content
    entries = orjson.loads(packed[8:8 + struct.unpack_from("<I", packed, 4)[0]])["arrays"]
    assert [e[0] for e in entries] == ["prompt_ids", "completion_ids", "completion_logprobs"]
    assert entries[0] == ["prompt_ids", "<i4", 10_000]


def test_logprobs_are_float32_when_that_is_exact_and_float64_otherwise():
    lp = [f32(-0.1 * i) for i in range(1, 9)]
    t = Trace(call_indices=[0], token_ids=list(range(8)), loss_mask=[1] * 8, logprobs=lp)
    rec = Trajectory(session_id="s", group_id="g", traces=[t])
    dtypes = lambda r: [e[1] for e in orjson.loads(_header(encode(r, packed=True)))["arrays"]]  # noqa: E731
    assert dtypes(rec) == ["<i4", "|u1", "<f4"]
    for odd in ([-0.1] * 8, [-1e-50] * 8, [-1e300] * 8):  # not float32 values: kept exactly
        r = rec.model_copy(update={"traces": [t.model_copy(update={"logprobs": odd})]})
        assert dtypes(r)[2] == "<f8"
        assert decode(encode(r, packed=True), Trajectory) == r


def _header(data: bytes) -> bytes:
    (n,) = struct.unpack_from("<I", data, 4)
    return data[8:8 + n]


def test_a_group_written_with_its_members_bytes_is_the_same_as_written_whole():
    members = [trajectory(f"s-{i}", float(i % 2)) for i in range(3)]
    group = TrainingGroup(group_id="task-1", trajectories=members, advantages=[1.0, -1.0, 0.5])
    known = [(m, encode(m, packed=True)) for m in members]
    assert encode(group, known, packed=True) == encode(group, packed=True)
    assert encode(group, known) == encode(group)  # packed members are not spliced into JSON
    assert decode(encode(group, known, packed=True), TrainingGroup) == group


def test_mixed_encodings_on_one_topic_decode_alike():
    records = [call("s-1", 0), call("s-1", 1, delta=True)]
    wire = [encode(records[0]), encode(records[1], packed=True)]
    assert [decode(d, CallRecorded) for d in wire] == records


@pytest.mark.parametrize("data, problem", [
    (MAGIC + b"\x01", "truncated"),
    (container(b"{not json"), "not valid JSON"),
    (container([1, 2]), "header must be"),
    (container({"record": {}, "arrays": [["x", "<i8", 1]]}), "expected [path, dtype, count]"),
    (container({"record": {"prompt_ids": None}, "arrays": [["prompt_ids", "<i4", 3]]}, b"\0" * 8), "runs past the end"),
    (container({"record": {"prompt_ids": None}, "arrays": [["prompt_ids", "<i4", 1]]}, b"\0" * 8), "bytes after"),
    (container({"record": {"request": None}, "arrays": [["request", "<i4", 1]]}, b"\0" * 4), "not a packed field"),
    (container({"record": {"prompt_ids": [1]}, "arrays": [["prompt_ids", "<i4", 1]]}, b"\0" * 4), "not a packed field"),
    (container({"record": {}, "arrays": [["traces.0.token_ids", "<i4", 1]]}, b"\0" * 4), "no 'traces'"),
    (MAGIC + struct.pack("<I", 1 << 30) + b"{}", "runs past the end"),
])
def test_a_malformed_container_is_one_clear_error(data, problem):
    with pytest.raises(RecordDecodeError, match="not a valid packed record") as e:
        decode(data, CallRecorded)
    assert problem in str(e.value)


def test_packed_arrays_are_validated_like_json_ones():
    good = encode(call(), packed=True)
    head = orjson.loads(_header(good))
    body = good[8 + len(_header(good)):]
    negative = struct.pack("<5i", 1, 2, -3, 4, 5) + body[20:]  # a token id must be a vocabulary index
    with pytest.raises(RecordDecodeError, match="prompt_ids.2"):
        decode(container(head, negative), CallRecorded)
    head["arrays"][1][2] = 2  # 2 completion ids for 3 logprobs
    with pytest.raises(RecordDecodeError):
        decode(container(head, body[:20] + body[20:28] + body[32:]), CallRecorded)
    with pytest.raises(RecordDecodeError, match="schema_version"):
        decode(encode(call().model_copy(update={"schema_version": 9}), packed=True), CallRecorded)


def test_packed_records_decode_with_their_arrays_set_aside():
    """The fast path (arrays checked in numpy, not by pydantic one by one) is the one taken for every
    record that holds arrays, and gives what validating the whole record gives."""
    from schemas import codec
    from schemas.packed import read

    members = [trajectory(f"s-{i}", float(i % 2)) for i in range(2)]
    group = TrainingGroup(group_id="task-1", trajectories=members, advantages=[1.0, -1.0])
    for record in (call(), call("s-1", 1, delta=True), members[0], group):
        obj, _, slots = read(encode(record, packed=True))
        aside = codec._arrays_aside(type(record), obj, slots)
        assert aside is not None and aside == record == decode(encode(record), type(record))


def test_a_record_with_a_validator_that_would_see_the_empty_arrays_is_validated_whole():
    from pydantic import field_validator

    from schemas import codec

    class Checked(Trajectory):
        @field_validator("task_set")
        @classmethod
        def _named(cls, value: str) -> str:
            return value

    assert codec._arrays_checkable(Trajectory) and codec._arrays_checkable(TrainingGroup)
    assert not codec._arrays_checkable(Checked)
    whole = trajectory()
    assert decode(encode(whole, packed=True), Checked) == Checked.model_validate(whole.model_dump())


def _trace_container(arrays: list[tuple[str, str, bytes, int]]) -> bytes:
    """A packed Trajectory of one trace whose arrays are given as (field, dtype, bytes, count)."""
    doc = orjson.loads(encode(trajectory()))
    trace = doc["traces"] = doc["traces"][:1]
    for name, *_ in arrays:
        trace[0][name] = None
    head = {"record": doc, "arrays": [[f"traces.0.{name}", dtype, n] for name, dtype, _, n in arrays]}
    return container(head, b"".join(blob for _, _, blob, _ in arrays))


IDS3 = ("token_ids", "<i4", struct.pack("<3i", 5, 6, 7), 3)
LOGPROBS3 = ("logprobs", "<f4", struct.pack("<3f", 0.0, -0.5, -1.25), 3)


@pytest.mark.parametrize("arrays, accepted", [
    ([IDS3, ("loss_mask", "|u1", bytes([0, 1, 1]), 3), LOGPROBS3], True),
    ([IDS3, ("loss_mask", "|u1", bytes([0, 2, 1]), 3), LOGPROBS3], False),  # a mask is 0 or 1
    ([IDS3, ("loss_mask", "|u1", bytes([0, 1]), 2), LOGPROBS3], False),  # lengths differ: the model validator
    ([("token_ids", "<i4", struct.pack("<3i", 5, -6, 7), 3), ("loss_mask", "|u1", bytes(3), 3), LOGPROBS3], False),
    ([IDS3, ("loss_mask", "|u1", bytes(3), 3), ("logprobs", "<f8", struct.pack("<3d", 0.0, float("inf"), 1.0), 3)], False),
    ([("token_ids", "<f8", struct.pack("<3d", 5.0, 6.0, 7.0), 3), ("loss_mask", "|u1", bytes(3), 3), LOGPROBS3], True),
    ([("token_ids", "<f8", struct.pack("<3d", 5.0, 6.5, 7.0), 3), ("loss_mask", "|u1", bytes(3), 3), LOGPROBS3], False),
    ([IDS3, ("loss_mask", "<i4", struct.pack("<3i", 0, 1, 0), 3), LOGPROBS3], True),  # another dtype: judged by the model
])
def test_arrays_set_aside_are_judged_as_the_json_record_is(arrays, accepted):
    """A packed record decodes exactly when the JSON record with the same content does, to the same
    record, whatever dtype its writer chose for each array."""
    packed = _trace_container(arrays)
    plain = orjson.dumps(document(packed))
    if accepted:
        assert decode(packed, Trajectory) == decode(plain, Trajectory)
        return
    with pytest.raises(RecordDecodeError):
        decode(plain, Trajectory)
    with pytest.raises(RecordDecodeError):
        decode(packed, Trajectory)


def test_records_without_arrays_and_old_json_records_still_decode():
    t = TaskRequest(task_id="t", instruction="x")
    assert encode(t, packed=True) == encode(t)
    c = call()
    old = orjson.dumps(orjson.loads(encode(c)))  # JSON as every earlier build wrote it
    assert decode(old, CallRecorded) == c


def test_the_stdlib_reader_in_the_docs_reads_both_encodings():
    """docs/events.md shows a reader that needs nothing of ours: it must read what we write."""
    text = (Path(__file__).parents[2] / "docs" / "events.md").read_text()
    code = text.split("<!-- reader -->")[1].split("<!-- /reader -->")[0].split("```python")[1].split("```")[0]
    scope: dict = {"__name__": "reader"}
    exec(compile(code, "events.md reader", "exec"), scope)
    assert len(code.strip().splitlines()) <= 30
    for record in sample_records():
        for packed in (False, True):
            got = scope["read_record"](encode(record, packed=packed))
            assert type(record).model_validate(got) == record or _f32_equal(type(record).model_validate(got), record)


def _f32_equal(a, b) -> bool:
    """Equal once each logprob is taken at the 9 digits the gateway records (the reader widens float32)."""
    fix = lambda o: [v and float32_digits(v) for v in o] if isinstance(o, list) and o and isinstance(o[0], float) else o  # noqa: E731

    def walk(x):
        if isinstance(x, dict):
            return {k: walk(fix(v)) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x
    return walk(a.model_dump()) == walk(b.model_dump())


@pytest.mark.parametrize("n", [40, 4000], ids=["one by one", "in bulk"])
def test_float32s_come_back_at_the_gateways_nine_digits(n):
    """Both ways of restoring (formatting few values, numpy for many) give what float32_digits gives."""
    import random

    from schemas.packed import restore_float32

    rng = random.Random(n)
    values = [f32(-rng.random() * rng.choice([1e-9, 1e-6, 1e-3, 1.0, 30.0, 1e5])) for _ in range(n)]
    values[:6] = [0.0, -0.0, -1.0, f32(-1e-30), f32(-9.9999999e8), f32(-3e38)]
    got = restore_float32(struct.pack(f"<{n}f", *values))
    assert [repr(v) for v in got] == [repr(v) for v in values]  # -0.0 stays -0.0


def test_a_traces_mostly_zero_logprobs_come_back_exact():
    """A trace's logprobs are zeros at its prompt positions: only the sampled ones are restored."""
    import random

    from schemas.packed import restore_float32

    rng = random.Random(7)
    for sampled in (3, 300):  # formatted, and in bulk
        values = [0.0] * 2000
        for i in rng.sample(range(2000), sampled):
            values[i] = f32(-rng.random() * rng.choice([1e-6, 1e-3, 1.0, 30.0]))
        values[5], values[6] = -0.0, -2.0  # a signed zero stays; an integral one stays a float
        got = restore_float32(struct.pack("<2000f", *values))
        assert [repr(v) for v in got] == [repr(v) for v in values]
