"""The record decoders and the delta resolver under fuzzing: what atheris found, and a short atheris run.

Each ``FOUND`` payload decoded into a record that could not be re-encoded or broke an invariant before
the fix (schemas/records.py: no inf/NaN, token ids >= 0, loss_mask in {0, 1}; schemas/codec.py: depth
limit); now each is refused with RecordDecodeError naming the problem. Crash files libFuzzer writes go
under tests/fuzz/regressions/records/ and are replayed here as they are.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from schemas import CallRecorded, RecordDecodeError, decode, encode

from .records_target import check_decode, check_one, samples

REPO = Path(__file__).resolve().parents[2]
CRASHES = Path(__file__).parent / "regressions" / "records"
DEEP = '{"a":' * 300 + "1" + "}" * 300


def _sample(type_name: str, **changes) -> bytes:
    doc = next(s for s in samples() if s["__type__"] == type_name)
    doc = {k: v for k, v in doc.items() if k != "__type__"} | changes
    return orjson.dumps(doc)


FOUND = {
    # lax mode read "inf" as float('inf'); orjson then wrote null, which no longer decodes
    "created_at_inf": ("PolicyVersion", lambda: _sample("PolicyVersion", created_at="inf")),
    "logprob_nan": ("CallRecorded", lambda: _sample("CallRecorded", completion_logprobs=["NaN", -1.0, -2.0])),
    "negative_token_id": ("CallRecorded", lambda: _sample("CallRecorded", completion_ids=[10, -1, 12])),
    "negative_prompt_id": ("CallRecorded", lambda: _sample("CallRecorded", prompt_ids=[1, 2, -3])),
    "loss_mask_two": ("Trajectory", lambda: orjson.dumps(
        {**orjson.loads(_sample("Trajectory")), "traces": [{"call_indices": [0], "token_ids": [1, 2], "loss_mask": [0, 2],
                                                            "logprobs": [0.0, -0.5]}]})),
    # decoded fine, then pydantic could not serialize it back ("Maximum serialization depth exceeded")
    "deep_metadata": ("TaskRequest", lambda: _sample("TaskRequest", metadata="__deep__").replace(b'"__deep__"', DEEP.encode())),
}


@pytest.mark.parametrize("name", list(FOUND))
def test_found_payloads_are_refused_with_a_named_error(name):
    type_name, payload = FOUND[name]
    from schemas import RECORD_TYPES

    with pytest.raises(RecordDecodeError):
        decode(payload(), RECORD_TYPES[type_name])
    check_decode(payload(), type_name)  # the fuzz target's own verdict agrees


def test_a_nan_logprob_cannot_even_be_built():
    """The producer side: the gateway can no longer publish a record no consumer could read back."""
    with pytest.raises(ValueError):
        CallRecorded(session_id="s", call_index=0, provider="engine", prompt_ids=[1], completion_ids=[2],
                     completion_logprobs=[float("nan")])


def test_every_sample_still_round_trips():
    from tests.schemas.samples import sample_records

    for record in sample_records():
        for packed in (False, True):
            assert decode(encode(record, packed=packed), type(record)) == record


@pytest.mark.parametrize("path", sorted(CRASHES.glob("crash-*")), ids=lambda p: p.name)
def test_saved_crash_inputs_no_longer_crash(path):
    check_one(path.read_bytes())


@pytest.mark.timeout(120)
def test_a_short_atheris_run_finds_nothing(tmp_path):
    """libFuzzer for 15 seconds from the saved inputs: exit 0 means no crash, no inconsistent record."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for path in CRASHES.glob("crash-*"):
        (corpus / path.name).write_bytes(path.read_bytes())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # Linux carries a process's peak RSS across fork and exec, and libFuzzer checks that peak: the
    # child of a long pytest run starts "using" what pytest used. So the limit is 1 GB above that.
    rss_limit = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024 + 1024
    proc = subprocess.run([sys.executable, "-m", "tests.fuzz.records_target", "-max_total_time=15", "-seed=1",
                           f"-rss_limit_mb={rss_limit}", f"-artifact_prefix={tmp_path}/", str(corpus)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [ln for ln in proc.stderr.splitlines() if ln.startswith("Done ")]
    assert runs and int(runs[0].split()[1]) > 100, proc.stderr[-1000:]  # it really ran
