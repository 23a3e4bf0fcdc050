"""The codec round-trips every record and turns any malformed payload into one error naming the field."""

from __future__ import annotations

import json
import random
import struct

import orjson
import pytest

from schemas import (
    RECORD_BY_TOPIC, RECORD_TYPES, CallRecorded, PolicyVersion, RecordDecodeError, SessionEvent, Trace, TrainingGroup,
    decode, derived_event_id, encode, float32_digits,
)
from tests.schemas.samples import call, sample_records, trajectory


@pytest.mark.parametrize("record", sample_records(), ids=lambda r: type(r).__name__)
def test_round_trip(record):
    data = encode(record)
    again = decode(data, type(record))
    assert again == record
    assert encode(again) == data  # stable bytes: re-encoding a decoded record changes nothing


def test_every_type_has_a_topic_and_a_sample():
    assert {type(r) for r in sample_records()} == set(RECORD_TYPES.values())
    assert set(RECORD_BY_TOPIC) == {"tasks", "sessions", "calls", "session-events", "trajectories", "groups", "policy",
                                   "judgements", "teacher"}


@pytest.mark.parametrize("record", sample_records(), ids=lambda r: type(r).__name__)
def test_encode_writes_the_bytes_of_pydantics_json_view(record):
    # encode lets orjson walk the models itself; it must stay byte-identical to the JSON of model_dump
    assert encode(record) == orjson.dumps(record.model_dump(mode="json"))


def test_encode_matches_pydantics_json_view_on_floats_escapes_and_unicode():
    floats = [1e-5, -0.0, 1e20, 3.0, 1e16, 1.5e300, 5e-324, 0.1, -2.5e-7, 123456789.125, 1e15]
    rec = call().model_copy(update={
        "session_id": 's\u00e9\U0001F600"\\\n\x01\u2028', "completion_ids": list(range(len(floats))),
        "completion_logprobs": floats, "request": {"a": [1, {"b": None}], "c": "\u2028x", "d": (1, 2)}})
    assert encode(rec) == orjson.dumps(rec.model_dump(mode="json"))
    assert decode(encode(rec), CallRecorded) == rec.model_copy(update={"request": {**rec.request, "d": [1, 2]}})


def test_records_inside_whose_bytes_are_known_are_written_as_those_bytes():
    a, b = trajectory("s-1", 1.0), trajectory("s-2", 0.0)
    group = TrainingGroup(group_id="g", trajectories=[a, b], advantages=[1.0, -1.0])
    assert group.trajectories[0] is a  # a group holds its members, not copies: their bytes can be reused
    assert encode(group, [(a, encode(a)), (b, encode(b))]) == encode(group)
    # What is given is written, unseen (so it must be what encode gave), and pairs of records not
    # inside, or equal but other objects, are ignored.
    marked = encode(group, [(a, orjson.dumps(orjson.loads(encode(a)), option=orjson.OPT_INDENT_2))])
    assert orjson.loads(marked) == orjson.loads(encode(group)) and marked.count(b"\n") > 10
    assert encode(group, [(trajectory("s-1", 1.0), b"{}"), (call(), b"[]")]) == encode(group)


def test_a_value_json_cannot_hold_is_refused_when_encoding():
    rec = call().model_copy(update={"request": {"when": object()}})
    with pytest.raises(TypeError):
        encode(rec)


@pytest.mark.parametrize("bad", [-1, 2**31, 2**70])
def test_token_ids_are_int32_vocabulary_indices(bad):
    obj = {**orjson.loads(encode(call())), "completion_ids": [5, bad], "completion_logprobs": [0.0, 0.0]}
    with pytest.raises(RecordDecodeError) as e:
        decode(json.dumps(obj).encode(), CallRecorded)  # stdlib json: orjson cannot write 2**70
    assert e.value.field == "completion_ids.1"
    assert decode(_payload(call(), completion_ids=[0, 2**31 - 1], completion_logprobs=[0.0, 0.0]),
                  CallRecorded).completion_ids == [0, 2**31 - 1]


def test_the_one_pass_decode_and_the_checked_one_agree():
    from schemas.codec import _decode_checked

    for record in sample_records():
        data = encode(record)
        assert decode(data, type(record)) == _decode_checked(data, type(record)) == record


def test_logprobs_survive_exactly():
    rec = call()
    rec = rec.model_copy(update={"completion_logprobs": [-1e-12, -123.456789012345, -0.1]})
    assert decode(encode(rec), CallRecorded).completion_logprobs == [-1e-12, -123.456789012345, -0.1]


def test_float32_digits_gives_back_every_float32_in_fewer_digits():
    rng = random.Random(0)
    wide = [struct.unpack("<f", struct.pack("<f", -rng.random() * 10 ** rng.randint(-8, 2)))[0] for _ in range(20_000)]
    short = [float32_digits(x) for x in wide]
    assert struct.pack(f"<{len(wide)}f", *short) == struct.pack(f"<{len(wide)}f", *wide)  # the same float32s
    assert [float32_digits(x) for x in short] == short  # already short: unchanged
    assert len(orjson.dumps(short)) < 0.7 * len(orjson.dumps(wide))


def _payload(record, **changes) -> bytes:
    obj = orjson.loads(encode(record))
    obj.update(changes)
    return orjson.dumps(obj)


@pytest.mark.parametrize("data, field, problem", [
    (b"{not json", "", "not valid JSON"),
    (b"[1, 2]", "", "expected a JSON object, got list"),
    (b'"text"', "", "expected a JSON object, got str"),
    (_payload(call(), schema_version=2), "schema_version", "unsupported version 2"),
    (_payload(call(), schema_version=None), "schema_version", "unsupported version None"),
    (_payload(call(), call_index="three"), "call_index", "integer"),
    (_payload(call(), call_index=-1), "call_index", "greater than or equal to 0"),
    (_payload(call(), provider="carrier.pigeon"), "provider", "anthropic.messages"),
    (_payload(call(), surprise=1), "surprise", "Extra inputs are not permitted"),
    (_payload(call(), session_id=""), "session_id", "at least 1 character"),
])
def test_malformed_payload_names_the_field(data, field, problem):
    with pytest.raises(RecordDecodeError) as e:
        decode(data, CallRecorded)
    assert e.value.record_type == "CallRecorded"
    assert e.value.field == field
    assert problem in e.value.problem
    assert str(e.value).startswith(f"CallRecorded.{field}:" if field else "CallRecorded:")


def _nested(depth: int) -> object:
    value: object = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def test_nesting_deeper_than_the_limit_is_refused_and_many_shallow_containers_are_not():
    from schemas.codec import MAX_DEPTH

    task = next(r for r in sample_records() if r.TOPIC == "tasks")
    # the record and its metadata are two levels: MAX_DEPTH - 2 more reach the limit exactly
    at_limit = _payload(task, metadata={"deep": _nested(MAX_DEPTH - 2)})
    assert decode(at_limit, type(task)).metadata["deep"] == _nested(MAX_DEPTH - 2)
    with pytest.raises(RecordDecodeError) as e:
        decode(_payload(task, metadata={"deep": _nested(MAX_DEPTH - 1)}), type(task))
    assert "nested deeper than" in e.value.problem
    # more brackets than the limit, all shallow (and a bracket inside a string): the walk runs and passes
    wide = _payload(task, metadata={f"k{i}": [[i], {"s": "[{"}] for i in range(200)})
    assert len(decode(wide, type(task)).metadata) == 200
    # text input is checked the same way as bytes
    with pytest.raises(RecordDecodeError):
        decode(_payload(task, metadata={"deep": _nested(MAX_DEPTH)}).decode(), type(task))


def test_nested_field_is_named_with_its_path():
    obj = orjson.loads(encode(call()))
    obj["output"]["tool_calls"][0]["name"] = 7
    with pytest.raises(RecordDecodeError) as e:
        decode(orjson.dumps(obj), CallRecorded)
    assert e.value.field == "output.tool_calls.0.name"


def test_cross_field_rules_are_enforced_on_decode():
    obj = orjson.loads(encode(call()))
    obj["completion_logprobs"] = [-0.5]  # three completion ids
    with pytest.raises(RecordDecodeError, match="completion_logprobs: 1 logprobs for 3 completion ids"):
        decode(orjson.dumps(obj), CallRecorded)
    obj = orjson.loads(encode(call()))
    obj["prompt_ids"] = None  # and no prompt_delta either
    with pytest.raises(RecordDecodeError, match="exactly one of prompt_ids and prompt_delta"):
        decode(orjson.dumps(obj), CallRecorded)


def test_missing_required_field():
    with pytest.raises(RecordDecodeError) as e:
        decode(b'{"schema_version": 1, "version": 3, "checkpoint_url": "x"}', PolicyVersion)
    assert (e.value.field, e.value.problem) == ("model", "Field required")


def test_wrong_record_type_is_an_error_not_a_coercion():
    with pytest.raises(RecordDecodeError) as e:
        decode(encode(call()), SessionEvent)
    assert e.value.record_type == "SessionEvent"


def test_trace_and_group_alignment():
    with pytest.raises(ValueError, match="loss_mask/logprobs"):
        Trace(call_indices=[0], token_ids=[1, 2], loss_mask=[0], logprobs=[0.0, 0.0])
    with pytest.raises(ValueError, match="advantages: 1 values for 0 trajectories"):
        TrainingGroup(group_id="g", trajectories=[], advantages=[1.0])


def test_event_ids():
    assert derived_event_id("g", 1, "x") == derived_event_id("g", 1, "x")
    assert derived_event_id("g", 1, "x") != derived_event_id("g", 1, "y")
    assert derived_event_id("ab", "c") != derived_event_id("a", "bc")  # parts are separated
    assert call().event_id != call().event_id
