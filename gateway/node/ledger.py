"""Which sessions of a polar.sessions partition are running, done, or were lost with a dead node.

Nodes consume polar.sessions as one consumer group and commit a partition's offset only up to its
oldest unfinished session, so a session whose node dies is delivered again to whichever node takes the
partition over. To tell a re-delivery apart from a first delivery, and to give the re-run a new attempt
number, every commit also carries metadata (Kafka stores a string with each committed offset)::

    {"node": "<id>", "live": {"<offset>": <attempt>, ...}, "done": [<offset>, ...]}

``live`` lists sessions started but not finished (a re-delivery of one is a re-run: attempt + 1),
``done`` lists finished sessions above the committed offset (a re-delivery of one is skipped). The node
commits when a session starts and when it finishes, so a crash loses at most the window between
publishing a finished event and committing it. Pure bookkeeping, no Kafka: unit-tested directly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MAX_METADATA = 3800  # brokers keep at most offset.metadata.max.bytes (4096 by default)


@dataclass
class Delivery:
    """What to do with a delivered session record."""

    skip: bool  # already finished (or committed): do nothing
    attempt: int  # attempt number to run it as
    lost_attempt: int | None = None  # the attempt that died with its node (to be marked), if any


@dataclass
class PartitionLedger:
    """Bookkeeping of one partition on this node."""

    node_id: str
    committed: int  # offset of the oldest session not known finished (what we commit)
    live: dict[int, int] = field(default_factory=dict)  # offset -> attempt running here
    done: set[int] = field(default_factory=set)  # finished offsets above ``committed``
    inherited: dict[int, int] = field(default_factory=dict)  # offset -> attempt that was live on a previous owner

    @classmethod
    def resume(cls, node_id: str, committed: int, metadata: str | None) -> "PartitionLedger":
        """A ledger for a newly assigned partition from its committed offset and metadata."""
        try:
            meta = json.loads(metadata) if metadata else {}
        except ValueError:
            meta = {}  # metadata written by someone else: treat as a plain offset
        inherited = {int(k): int(v) for k, v in (meta.get("live") or {}).items() if int(k) >= committed}
        done = {int(o) for o in meta.get("done") or [] if int(o) >= committed}
        return cls(node_id, max(committed, 0), inherited=inherited, done=done)

    def deliver(self, offset: int, record_attempt: int) -> Delivery:
        """Classify a delivered record and, unless skipped, mark it live."""
        if offset < self.committed or offset in self.done or offset in self.live:
            return Delivery(skip=True, attempt=self.live.get(offset, record_attempt))
        if offset > self.committed and not self.live and not any(o < offset for o in (*self.done, *self.inherited)):
            # Records before this one were never delivered to anyone (no commit yet, or removed by
            # retention): nothing below it can still be open, so the commit point moves up to it.
            self.done = {o for o in self.done if o > offset}
            self.committed = offset
        lost = self.inherited.pop(offset, None)
        attempt = max(record_attempt, lost + 1) if lost is not None else record_attempt
        self.live[offset] = attempt
        return Delivery(skip=False, attempt=attempt, lost_attempt=lost)

    def undeliver(self, offset: int, delivery: Delivery) -> None:
        """Take back a delivery that was never run (its live mark could not be committed): the record
        is delivered again later, as the same attempt."""
        self.live.pop(offset, None)
        if delivery.lost_attempt is not None:
            self.inherited[offset] = delivery.lost_attempt

    def finish(self, offset: int) -> None:
        """Mark a session finished and advance the commit point over every contiguous finished offset."""
        self.live.pop(offset, None)
        if offset < self.committed:
            return
        self.done.add(offset)
        while self.committed in self.done:
            self.done.discard(self.committed)
            self.committed += 1

    def skip(self, offset: int) -> None:
        """A delivered record needs no work (already finished elsewhere): treat it as finished."""
        self.finish(offset)

    def lowest_open(self) -> int:
        """Commit point: the oldest offset that is neither finished nor skipped."""
        return self.committed

    def metadata(self) -> str:
        """Commit metadata; inherited-but-not-yet-redelivered entries are kept so they survive us too."""
        live = {**{str(o): a for o, a in self.inherited.items()}, **{str(o): a for o, a in self.live.items()}}
        meta = {"node": self.node_id, "live": live, "done": sorted(self.done)}
        text = json.dumps(meta, separators=(",", ":"))
        if len(text) > MAX_METADATA:  # too many finished offsets ahead of a straggler: keep live, drop oldest done
            meta["done"] = sorted(self.done)[-(MAX_METADATA // 16):]
            text = json.dumps(meta, separators=(",", ":"))
        return text
