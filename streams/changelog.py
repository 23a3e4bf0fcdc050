"""Table writes whose changelog records go out once per commit, compacted.

Faust sends a changelog record for every table write as it happens. A session's state is rewritten on
each of its calls, and a call's reference is written when it arrives and deleted when its session is
assembled, so in a burst most of those records were superseded a second later: the worker spent about
a third of its event loop building and producing them. Here a stage writes the tables' in-memory stores
directly and ``Changelog`` keeps, per key, only the last value written since the previous flush (and
none at all for a key written and deleted in between that the changelog never held). ``flush`` sends
them, in the order of each key's last write, through the table's own ``send_changelog``.

Crash safety is Faust's at-least-once unchanged: the app flushes its producer before it commits any
input offset (app._flush_means_flushed calls ``flush`` first), so the changelog holds every write made
for the inputs a commit covers. A crash before that loses writes whose inputs are not committed, and
their replay writes them again. Keys go out in the order of their last write, so a write that the
stages order after another (a session's done marker before its calls' deletes, a member's reference
before its gathering entry's delete) still reaches the changelog after it.
"""

from __future__ import annotations

from typing import Any


class Changelog:
    """Pending changelog records of Faust tables, by (table, key): the last value written, or None to
    delete, with the partition it was written in and whether the changelog may hold the key."""

    def __init__(self, tables: dict[str, Any]):  # name -> faust Table
        self.tables = tables
        self.pending: dict[tuple[str, str], tuple[int, bytes | None, bool]] = {}
        self.sent = 0  # records sent, for the counters

    def note(self, table: str, key: str, partition: int, value: bytes | None, held: bool) -> None:
        """``key`` of ``table`` was set to ``value`` (None: deleted) in ``partition``; ``held``: it was
        in the table before this write (so its changelog may hold it)."""
        k = (table, key)
        before = self.pending.pop(k, None)  # re-inserted last: flushed in the order of last writes
        if before is not None:
            held = before[2]  # what the changelog held when this key was first written since the flush
        if value is None and not held:
            return  # written and deleted since the flush: the changelog never had it
        self.pending[k] = (partition, value, held)

    def flush(self) -> int:
        """Send the pending records (to the producer's buffer); how many."""
        pending, self.pending = self.pending, {}
        for (table, key), (partition, value, _held) in pending.items():
            t = self.tables[table]
            if value is None:
                t.send_changelog(partition, key, None, value_serializer="raw")
            else:
                t.send_changelog(partition, key, value)
        self.sent += len(pending)
        return len(pending)
