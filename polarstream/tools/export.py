"""SFT / offline-RL datasets from recorded trajectories or groups, as JSON lines or parquet.

One row per trace (a training sequence): ``input_ids`` with its ``loss_mask`` (1 on tokens the policy
sampled) and the rollout ``logprobs``, plus the trajectory's reward and status and, when exported from
polar.groups, the trace's ``advantage``. Both formats load with the HF ``datasets`` library
(``load_dataset("parquet", data_files=...)`` / ``load_dataset("json", data_files=...)``) or with
pyarrow / plain JSON. Rows come in the deterministic order of ``kafka_read.merged``.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from infra.settings import Settings
from schemas import Parts, RecordDecodeError, TrainingGroup, Trajectory, decode

from .evaluate import Latest
from producers.kafka_read import RawMessage

FORMATS = ("jsonl", "parquet")
_ROW_GROUP = 1_000


@dataclass(frozen=True)
class Filters:
    """Which traces to export."""

    min_reward: float | None = None
    harness: str | None = None
    policy_version: int | None = None  # every call of the trace was sampled by this version
    include_unusable: bool = False  # trajectories masked out of training (infra failures, broken assembly)
    include_side_calls: bool = False  # traces of side calls (titles, quota checks)


def _columns():
    import pyarrow as pa

    return pa.schema([
        ("trajectory_id", pa.string()), ("session_id", pa.string()), ("group_id", pa.string()),
        ("task_id", pa.string()), ("sample_index", pa.int32()), ("attempt", pa.int32()),
        ("harness", pa.string()), ("task_set", pa.string()), ("status", pa.string()), ("reward", pa.float64()),
        ("usable", pa.bool_()), ("builder", pa.string()), ("trace_index", pa.int32()),
        ("call_indices", pa.list_(pa.int32())), ("policy_versions", pa.list_(pa.int32())),
        ("break_reason", pa.string()), ("side_call", pa.bool_()),
        ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())), ("logprobs", pa.list_(pa.float64())),
        ("advantage", pa.float64()), ("num_tokens", pa.int32()), ("num_sampled", pa.int32()),
    ])


def trace_rows(traj: Trajectory, filters: Filters, skipped: Counter, advantage: float | None = None) -> Iterator[dict]:
    """The rows of one trajectory that pass ``filters``; what is left out is counted in ``skipped``."""
    if not traj.usable and not filters.include_unusable:
        skipped["unusable"] += len(traj.traces)
        return
    if filters.min_reward is not None and traj.reward < filters.min_reward:
        skipped["reward"] += len(traj.traces)
        return
    if filters.harness is not None and traj.harness != filters.harness:
        skipped["harness"] += len(traj.traces)
        return
    for i, tr in enumerate(traj.traces):
        if tr.side_call and not filters.include_side_calls:
            skipped["side_call"] += 1
            continue
        if filters.policy_version is not None and any(v != filters.policy_version for v in tr.policy_versions):
            skipped["policy_version"] += 1
            continue
        yield {
            "trajectory_id": traj.event_id, "session_id": traj.session_id, "group_id": traj.group_id,
            "task_id": traj.task_id, "sample_index": traj.sample_index, "attempt": traj.attempt,
            "harness": traj.harness, "task_set": traj.task_set, "status": traj.status, "reward": traj.reward,
            "usable": traj.usable, "builder": traj.builder, "trace_index": i,
            "call_indices": tr.call_indices, "policy_versions": tr.policy_versions,
            "break_reason": tr.break_reason, "side_call": tr.side_call,
            "input_ids": tr.token_ids, "loss_mask": tr.loss_mask, "logprobs": tr.logprobs,
            "advantage": advantage, "num_tokens": len(tr.token_ids), "num_sampled": sum(tr.loss_mask),
        }


@dataclass
class ExportStats:
    rows: int = 0
    trajectories: int = 0
    groups: int = 0
    duplicates: int = 0
    superseded: int = 0
    undecodable: int = 0
    skipped: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict:
        return {"rows": self.rows, "trajectories": self.trajectories, "groups": self.groups,
                "duplicates": self.duplicates, "superseded": self.superseded, "undecodable": self.undecodable,
                "skipped_traces": dict(sorted(self.skipped.items()))}


def rows_from(messages: Iterable[RawMessage], source: str, filters: Filters, stats: ExportStats) -> Iterator[dict]:
    """Rows from messages of polar.trajectories or polar.groups, deduplicated like every reader.

    From trajectories, a retried sample's latest attempt wins, so the whole input is read before the
    first row; groups already hold one trajectory per sample and stream straight through."""
    if source == "trajectories":
        latest, kept = Latest(), {}
        for msg in messages:
            traj = _decode(msg, Trajectory, stats)
            if traj is not None and (whole := latest.take(traj)) is not None:  # one sent in parts: whole
                kept[(whole.group_id, whole.sample_index)] = whole
        stats.duplicates, stats.superseded = latest.duplicates, latest.superseded
        for traj in kept.values():
            stats.trajectories += 1
            yield from trace_rows(traj, filters, stats.skipped)
        return
    seen: set[str] = set()
    joiner = Parts()  # a group sent in parts is exported whole (its trajectories whole, too)
    for msg in messages:
        group = _decode(msg, TrainingGroup, stats)
        if group is None:
            continue
        if group.part_of in seen:  # a part of a group exported already, again
            stats.duplicates += 1
            continue
        if (group := joiner.add(group)) is None:
            continue
        if group.event_id in seen:
            stats.duplicates += 1
            continue
        seen.add(group.event_id)
        stats.groups += 1
        for traj, adv in zip(group.trajectories, group.advantages):
            stats.trajectories += 1
            yield from trace_rows(traj, filters, stats.skipped, adv)


def _decode(msg: RawMessage, cls, stats: ExportStats):
    try:
        return decode(msg.value, cls)
    except RecordDecodeError:
        stats.undecodable += 1
        return None


def write_rows(rows: Iterable[dict], fmt: str, out: str, settings: Settings, stats: ExportStats) -> None:
    """Write ``rows`` to ``out`` (a local path, file:// or s3:// URL). The file is built beside the
    target (or locally, for s3) and moved into place at the end: a reader never sees half a dataset,
    and a failed export leaves whatever was at ``out`` untouched."""
    from infra.storage import filesystem

    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    fs, path = filesystem(out, settings)
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    local = "file" in protocols
    if local:  # beside the target, so the final rename stays on one filesystem (and keeps the umask's mode)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = str(Path(path).with_name(f".{Path(path).name}.{uuid.uuid4().hex[:8]}.tmp"))
    else:
        fd, tmp = tempfile.mkstemp(prefix="polar-export-", suffix=f".{fmt}")
        os.close(fd)
    try:
        (_write_parquet if fmt == "parquet" else _write_jsonl)(rows, tmp, stats)
        if local:
            os.replace(tmp, path)
        else:
            fs.put_file(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write_jsonl(rows: Iterable[dict], tmp: str, stats: ExportStats) -> None:
    with open(tmp, "wb") as f:
        for row in rows:
            f.write(orjson.dumps(row))
            f.write(b"\n")
            stats.rows += 1


def _write_parquet(rows: Iterable[dict], tmp: str, stats: ExportStats) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _columns()
    batch: list[dict] = []
    with pq.ParquetWriter(tmp, schema) as writer:  # an empty export is still a valid, typed file
        for row in rows:
            batch.append(row)
            if len(batch) >= _ROW_GROUP:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                stats.rows += len(batch)
                batch = []
        if batch:
            writer.write_table(pa.Table.from_pylist(batch, schema=schema))
            stats.rows += len(batch)
