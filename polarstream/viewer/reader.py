"""The viewer's reader: one thread per topic prefix, reading its topics into a RunIndex.

It reads like the other tools (producers/kafka_read.py): partitions assigned under a consumer
group of its own that never commits, so live consumers never notice it. First everything up to the end
offsets at start (``caught_up`` then), then whatever is appended, as it comes.
"""

from __future__ import annotations

import logging
import threading

from infra.settings import Settings

from producers.kafka_read import ReadError, fresh_group, merged, plan_spans, tail
from .index import TOPICS, RunIndex

log = logging.getLogger("polarstream.viewer")


class Reader(threading.Thread):
    """Feeds ``index`` from the topics of ``settings``' prefix until ``stop()``."""

    def __init__(self, settings: Settings, index: RunIndex, retry_s: float = 5.0, poll_s: float = 0.5):
        super().__init__(name=f"viewer-reader-{settings.topic_prefix or 'default'}", daemon=True)
        self.settings, self.index, self.retry_s, self.poll_s = settings, index, retry_s, poll_s
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self._read()
                return
            except ReadError as e:  # topics not created yet, broker away: say so on the page, try again
                self.index.error = str(e)
                log.warning("viewer: %s; retrying in %.0fs", e, self.retry_s)
                self._stop.wait(self.retry_s)

    def _read(self) -> None:
        spans = plan_spans(self.settings, TOPICS)
        self.index.error = ""
        for msg in merged(self.settings, spans, fresh_group("ui")):
            self.index.feed(msg.topic, msg.value)
            if self._stop.is_set():
                return
        self.index.caught_up = True
        for batch in tail(self.settings, spans, fresh_group("ui-follow"), poll_s=self.poll_s):
            for msg in batch:
                self.index.feed(msg.topic, msg.value)
            if self._stop.is_set():
                return
