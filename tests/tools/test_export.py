"""Dataset rows from trajectories and groups: filters, and files that round-trip ids, masks and logprobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from polarstream.tools.export import ExportStats, Filters, rows_from, trace_rows, write_rows
from producers.kafka_read import RawMessage
from schemas import TrainingGroup, encode
from tests.tools.samples import traj

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def messages(topic, records):
    # every other record packed: a topic written by an old (JSON) and a new (packed) producer
    return [RawMessage(topic, 0, i, 0, r.key().encode(), encode(r, packed=i % 2 == 1)) for i, r in enumerate(records)]


def test_filters_and_counts():
    trajs = [traj("a", 0, 1.0, side_call=True, compaction=True), traj("a", 1, 0.0), traj("a", 2, 1.0, "infra_error"),
             traj("b", 0, 1.0, harness="claude_code", version=2)]
    skipped = Counter()
    rows = [r for t in trajs for r in trace_rows(t, Filters(), skipped)]
    # a-s0: two main traces (compaction), its side-call trace left out; a-s1 one; a-s2 masked; b-s0 one.
    assert [(r["session_id"], r["trace_index"]) for r in rows] == [("a-s0-a0", 0), ("a-s0-a0", 1), ("a-s1-a0", 0), ("b-s0-a0", 0)]
    assert skipped == {"side_call": 1, "unusable": 1}

    def keep(**kw):
        return [(r["session_id"], r["trace_index"]) for t in trajs for r in trace_rows(t, Filters(**kw), Counter())]

    assert keep(min_reward=0.5) == [("a-s0-a0", 0), ("a-s0-a0", 1), ("b-s0-a0", 0)]
    assert keep(harness="claude_code") == [("b-s0-a0", 0)]
    assert keep(policy_version=2) == [("b-s0-a0", 0)]
    assert len(keep(include_unusable=True, include_side_calls=True)) == 6


def test_rows_from_groups_carry_advantages_and_skip_repeats():
    members = [traj("g", 0, 1.0), traj("g", 1, 0.0)]
    group = TrainingGroup(event_id="grp", group_id="g", trajectories=members, advantages=[1.0, -1.0])
    stats = ExportStats()
    rows = list(rows_from(messages("groups", [group, group]), "groups", Filters(), stats))
    assert [r["advantage"] for r in rows] == [1.0, -1.0]
    assert (stats.groups, stats.duplicates, stats.trajectories) == (1, 1, 2)


def test_rows_from_trajectories_keep_the_latest_attempt():
    trajs = [traj("g", 0, 0.0, "infra_error"), traj("g", 0, 1.0, attempt=1), traj("g", 1, 1.0), traj("g", 1, 1.0)]
    stats = ExportStats()
    raw = messages("trajectories", trajs) + [RawMessage("trajectories", 0, 9, 0, None, b"junk")]
    rows = list(rows_from(raw, "trajectories", Filters(), stats))
    assert [(r["sample_index"], r["attempt"], r["advantage"]) for r in rows] == [(0, 1, None), (1, 0, None)]
    assert (stats.duplicates, stats.superseded, stats.undecodable) == (1, 1, 1)


def test_records_sent_in_parts_export_as_the_whole_ones():
    """Trajectories and groups past their topic's limit arrive in parts (schemas/parts.py): the rows are
    those of the whole records, each once, even with a part delivered twice."""
    from schemas import split_record

    members = [traj("g", 0, 1.0, compaction=True, side_call=True), traj("g", 1, 0.0, compaction=True, side_call=True)]
    group = TrainingGroup(event_id="grp", group_id="g", trajectories=members, advantages=[1.0, -1.0])
    for topic, records, whole in (("groups", [group], [group]), ("trajectories", members, members)):
        want = list(rows_from(messages(topic, whole), topic, Filters(include_side_calls=True), ExportStats()))
        parts = [p for r in records for p, _ in split_record(r, len(encode(r)) - 1)]  # just past the limit
        assert len(parts) > len(records)
        stats = ExportStats()
        got = list(rows_from(messages(topic, [*parts, parts[0]]), topic, Filters(include_side_calls=True), stats))
        assert got == want and stats.duplicates == 1, topic


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_files_round_trip_token_ids_masks_and_logprobs(tmp_path, fmt, polar_settings_offline):
    trajs = [traj("g", 0, 1.0, turns=3, compaction=True), traj("g", 1, 0.5, turns=2)]
    expected = [r for t in trajs for r in trace_rows(t, Filters(), Counter())]
    out = tmp_path / "sub" / f"data.{fmt}"
    stats = ExportStats()
    write_rows(iter(expected), fmt, str(out), polar_settings_offline, stats)
    assert stats.rows == 3 and [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary file left
    if fmt == "parquet":
        table = pq.read_table(out)
        assert table.schema.field("input_ids").type == pa.list_(pa.int32())
        assert table.schema.field("loss_mask").type == pa.list_(pa.int8())
        got = table.to_pylist()
    else:
        got = [json.loads(line) for line in out.read_text().splitlines()]
    assert got == expected  # ids, masks, float64 logprobs and the rest, exactly


# HF `datasets` cannot live in .venv (every release that accepts our fsspec pin needs click>=8.4.2, which
# faust forbids; see docs/replay-and-eval.md), so the check runs in a peer venv that has it on top of our
# packages: POLAR_DATASETS_PYTHON, else the peer venv `make datasets-peer` builds (make test does), else the
# TRL peer venv of bench/trainer.py, else datasets in-process. Only the loading runs there; writing is ours.
_PEERS = Path.home() / ".cache/polarstream/peers"
_CANDIDATES = [Path(p) for p in (os.environ.get("POLAR_DATASETS_PYTHON"),) if p] + [
    _PEERS / "datasets-venv/bin/python", _PEERS / "trl-venv/bin/python"]
_LOAD = """
import json, sys, datasets
out = {}
for fmt, path in (("parquet", sys.argv[1]), ("json", sys.argv[2])):
    ds = datasets.load_dataset(fmt, data_files=path, split="train", cache_dir=sys.argv[3])
    out[fmt] = {"rows": ds.to_list(), "features": {k: str(v) for k, v in ds.features.items()}}
print(json.dumps({"version": datasets.__version__, **out}))
"""


def _datasets_python() -> list[str]:
    for peer in _CANDIDATES:
        if peer.exists() and subprocess.run([str(peer), "-c", "import datasets"], capture_output=True).returncode == 0:
            return [str(peer)]
    pytest.importorskip("datasets", reason="HF datasets is neither importable here nor in a peer venv: run "
                        "`make datasets-peer` (see docs/replay-and-eval.md)")
    return [sys.executable]


def test_loads_with_hf_datasets(tmp_path, polar_settings_offline):
    python = _datasets_python()
    rows = [r for t in (traj("g", 0, 1.0, turns=3, compaction=True), traj("g", 1, 0.5, turns=2))
            for r in trace_rows(t, Filters(), Counter(), 0.5)]
    files = [tmp_path / "d.parquet", tmp_path / "d.jsonl"]
    for out in files:
        write_rows(iter(rows), out.suffix[1:], str(out), polar_settings_offline, ExportStats())
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([*python, "-c", _LOAD, *map(str, files), str(tmp_path / "cache")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["parquet"]["rows"] == rows == got["json"]["rows"]  # token ids, masks, logprobs, all columns
    assert got["parquet"]["features"]["input_ids"] == "List(Value('int32'))"
    assert got["parquet"]["features"]["loss_mask"] == "List(Value('int8'))"


def test_unknown_format_leaves_the_target_alone(tmp_path, polar_settings_offline):
    out = tmp_path / "keep.jsonl"
    out.write_text("old\n")
    with pytest.raises(ValueError, match="--format"):
        write_rows(iter([]), "csv", str(out), polar_settings_offline, ExportStats())
    assert out.read_text() == "old\n"


@pytest.fixture
def polar_settings_offline(tmp_path):
    from infra.settings import Settings

    return Settings(data_dir=tmp_path / "polar")


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_failed_export_leaves_the_previous_file(tmp_path, fmt, polar_settings_offline):
    out = tmp_path / f"keep.{fmt}"
    out.write_bytes(b"previous")
    good = list(trace_rows(traj("g", 0, 1.0), Filters(), Counter()))

    def rows():
        yield from good
        raise RuntimeError("the broker went away")

    with pytest.raises(RuntimeError, match="went away"):
        write_rows(rows(), fmt, str(out), polar_settings_offline, ExportStats())
    assert out.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == [out.name]
