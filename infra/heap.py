"""Short garbage-collector pauses for long-running servers (gateway, node, streams worker).

CPython's full collection traverses every tracked object. A gateway's start-up heap (imported modules,
the tokenizer, the chat template) is large and lives forever, so each full collection walked it again:
logged inside a gateway during ``bench/gateway.py --quick``, the two full collections of the run took
about half a second each, a stall for every call in flight. ``gc.freeze()`` moves what is alive at that
moment into a permanent generation that collections skip; objects made later are collected as before.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then keep everything still alive out of future collections; the frozen count.

    Call it in a server's own process, after start-up and before serving (not from a library or a test
    process: it is process-wide)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
