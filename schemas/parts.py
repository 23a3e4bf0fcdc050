"""A Trajectory or TrainingGroup too large for one Kafka record travels as parts; readers join them.

Kafka bounds a record (polar.trajectories: 32 MiB, polar.groups: 64 MiB), and these records hold every
token id and logprob of a session, or of a whole group: eight per_request trajectories of 48-turn
sessions are already past the group limit, one long per_request session past the trajectory limit.
Such records used to be dropped. Now the streams send one as ``parts`` records, each a valid record of
the same type with a share of its list (a trajectory's traces; a group's trajectories, with their
advantages) and all of its other fields, ``part`` its index and ``part_of`` the whole one's event id.
A part's event id derives from the whole one's, so a re-send is byte-identical.

A group that holds a trajectory too large for a part alone carries that trajectory as its parts (each
with the trajectory's advantage). Training needs nothing joined: traces are independent sequences and
advantages are computed over the whole group before splitting, so the trainer trains each group part
as it comes. Readers that show or count whole records (the group stage, evaluation, export, the viewer,
the demo) join them with ``Parts``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from .codec import encode
from .packed import NESTING_BYTES_PER_ARRAY, array_count, pack
from .records import Record, TrainingGroup, Trajectory, derived_event_id

P = TypeVar("P", Trajectory, TrainingGroup)

# What a part takes a share of (the first list is the one split; the others are aligned with it), and
# what only the first part lists.
_SHARED = {Trajectory: (("traces",), ()), TrainingGroup: (("trajectories", "advantages"), ("masked", "masked_reasons"))}
# Bytes an item adds to a part beyond its own encoding: a group member's advantage (a float, at most 24
# characters as JSON) and the commas.
_PER_ITEM = 32
# A packed trace, sized alone, grows by its arrays' longer paths once inside a trajectory inside a group.
_TRACE_NESTING = 2 * 3 * NESTING_BYTES_PER_ARRAY


class RecordTooLarge(ValueError):
    """One item (a trace) does not fit in a record of the limit even alone."""


def split_record(record: P, max_bytes: int, encoded: Iterable[tuple[Record, bytes]] = (), *,
                 packed: bool = False) -> list[tuple[P, bytes]]:
    """``record`` as records of at most ``max_bytes`` each, with their bytes (``packed``: as
    ``encode(..., packed=True)``): the record itself when it fits, else its parts. Raises RecordTooLarge
    when a single trace cannot fit in any part. ``encoded``: records inside it whose bytes are known."""
    data = encode(record, encoded, packed=packed)
    if len(data) <= max_bytes:
        return [(record, data)]
    lists, first_only = _SHARED[type(record)]
    # The most a part's own fields take: the record's, without its lists, with the largest part numbers.
    shell = len(encode(record.model_copy(update={**{f: type(getattr(record, f))() for f in (*lists, *first_only)}, "part": 10**6,
                                                 "parts": 10**6 + 1, "part_of": record.event_id})))
    shell += _PER_ITEM if packed else 0  # the container's framing
    items = [[getattr(record, f)[i] for f in lists] for i in range(len(getattr(record, lists[0])))]
    if isinstance(record, TrainingGroup):  # a member too large for a part alone goes as its own parts
        budget = max_bytes - shell - _PER_ITEM
        pieces = [(piece, size, adv) for traj, adv in items for piece, size in _pieces(traj, budget, packed)]
        items, sizes = [[piece, adv] for piece, _, adv in pieces], [size + _PER_ITEM for _, size, _ in pieces]
    else:
        sizes = [_trace_size(item[0], packed) + _PER_ITEM for item in items]
    batches: list[list[int]] = [[]]
    used = shell + sum(len(encode(getattr(record, f))) for f in first_only)
    for i, size in enumerate(sizes):
        if shell + size > max_bytes:
            raise RecordTooLarge(f"{type(record).__name__} {record.event_id}: one trace alone is {size} bytes, "
                                 f"over the record limit of {max_bytes}")
        if batches[-1] and used + size > max_bytes:
            batches.append([])
            used = shell
        batches[-1].append(i)
        used += size
    n = len(batches)
    out = []
    for k, idx in enumerate(batches):
        update = {f: [items[i][j] for i in idx] for j, f in enumerate(lists)}
        update.update({f: getattr(record, f) if k == 0 else type(getattr(record, f))() for f in first_only})
        part = record.model_copy(update={**update, "event_id": derived_event_id("part", record.event_id, k, n),
                                         "part": k, "parts": n, "part_of": record.event_id})
        out.append((part, encode(part, packed=packed)))
    return out


def _pieces(traj: Trajectory, budget: int, packed: bool) -> list[tuple[Trajectory, int]]:
    """The trajectory, or its parts when over ``budget``, each with its encoded size (encoded once) as
    a member of a group: a packed one's arrays get longer paths there."""
    limit = budget
    while True:
        pieces = [(piece, len(data) + NESTING_BYTES_PER_ARRAY * array_count(data))
                  for piece, data in split_record(traj, limit, packed=packed)]
        over = max(size for _, size in pieces) - budget
        if over <= 0:
            return pieces
        limit -= over  # a whole one that fit alone but not nested: split it a little finer


def _trace_size(trace, packed: bool) -> int:
    data = pack(trace) if packed else None  # None: a trace without tokens stays JSON
    return len(encode(trace)) if data is None else len(data) + _TRACE_NESTING


def join_parts(parts: list[P]) -> P:
    """The whole record from all of its parts (any order): what ``split_record`` was given."""
    ordered = sorted(parts, key=lambda p: p.part)
    first = ordered[0]
    if [p.part for p in ordered] != list(range(first.parts)) or any(p.part_of != first.part_of for p in ordered):
        raise ValueError(f"{type(first).__name__} {first.part_of}: parts {[p.part for p in ordered]} of "
                         f"{first.parts} do not make one record")
    lists, _ = _SHARED[type(first)]
    update = {f: [x for p in ordered for x in getattr(p, f)] for f in lists}
    if isinstance(first, TrainingGroup):  # members that went as their own parts
        update["trajectories"], update["advantages"] = _rejoin(update["trajectories"], update["advantages"])
    return first.model_copy(update={**update, "event_id": first.part_of, "part": 0, "parts": 1, "part_of": ""})


def _rejoin(trajs: list[Trajectory], advs: list[float]) -> tuple[list[Trajectory], list[float]]:
    out_t: list[Trajectory] = []
    out_a: list[float] = []
    run: list[Trajectory] = []
    for t, a in zip(trajs, advs):
        if t.parts == 1:
            out_t.append(t)
            out_a.append(a)
            continue
        run.append(t)
        if len(run) == t.parts:
            out_t.append(join_parts(run))
            out_a.append(a)
            run = []
    return out_t, out_a


class Parts:
    """Joins records that arrive in parts: ``add`` returns a whole record (at once for an unsplit one,
    with the last of its parts for a split one) or None while parts are still missing."""

    def __init__(self) -> None:
        self._held: dict[str, dict[int, Trajectory | TrainingGroup]] = {}  # whole one's event id -> part -> record

    def add(self, record: P) -> P | None:
        if record.parts == 1:
            return record
        held = self._held.setdefault(record.part_of, {})
        held[record.part] = record
        if len(held) < record.parts:
            return None
        del self._held[record.part_of]
        return join_parts(list(held.values()))  # type: ignore[arg-type]
