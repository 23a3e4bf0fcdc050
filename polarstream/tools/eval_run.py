"""``polarstream eval`` behind the command line: read polar.trajectories, keep the report current.

A bounded pass reads every partition up to the end offsets captured at start; ``follow`` then keeps
reading what collection appends and rewrites the report at most every ``refresh_s`` seconds when
something changed. Nothing is committed: the reader is invisible to the live consumers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from infra.settings import Settings
from schemas import RecordDecodeError, Trajectory, decode

from .evaluate import Latest, evaluate
from producers.kafka_read import RawMessage, fresh_group, merged, plan_spans, tail
from .report import write_report


@dataclass
class EvalState:
    """The samples seen so far and how the input looked."""

    topic: str
    ks: tuple[int, ...]
    threshold: float
    failures_fail: bool = False  # failed and infra_error samples count as not passing (evaluate.py)
    latest: Latest = field(default_factory=Latest)
    read: int = 0
    undecodable: int = 0

    def feed(self, msg: RawMessage) -> bool:
        """Take one message of polar.trajectories; True when it changed the samples."""
        self.read += 1
        try:
            traj = decode(msg.value, Trajectory)
        except RecordDecodeError:
            self.undecodable += 1
            return False
        return self.latest.add(traj)

    def report(self) -> dict:
        """The JSON report (``report.write_report`` renders it)."""
        return {
            "source": {"topic": self.topic, "messages": self.read, "trajectories": len(self.latest.seen),
                       "duplicates": self.latest.duplicates, "superseded": self.latest.superseded,
                       "undecodable": self.undecodable},
            "ks": sorted({1, *self.ks}),
            "threshold": self.threshold,
            "cells": evaluate(self.latest.samples.values(), self.ks, self.threshold, self.failures_fail),
        }


def run_eval(settings: Settings, ks: tuple[int, ...] = (1,), threshold: float = 1.0, out_dir: Path | None = None,
             follow: bool = False, refresh_s: float = 5.0, duration_s: float = 0.0,
             on_update: Callable[[dict], None] | None = None, stop: threading.Event | None = None,
             failures_fail: bool = False) -> dict:
    """Evaluate what polar.trajectories holds now; with ``follow``, keep going (``duration_s`` 0: until
    interrupted or ``stop`` is set) and refresh the report files. Returns the last report."""
    state = EvalState(settings.topic("trajectories"), tuple(ks), threshold, failures_fail)
    spans = plan_spans(settings, ("trajectories",))
    for msg in merged(settings, spans, fresh_group("eval")):
        state.feed(msg)
    report = state.report()
    _publish(report, out_dir, on_update)
    if not follow:
        return report
    deadline = time.monotonic() + duration_s if duration_s > 0 else float("inf")
    dirty, last = False, time.monotonic()
    try:
        for batch in tail(settings, spans, fresh_group("eval-follow"), poll_s=min(1.0, refresh_s)):
            for msg in batch:
                dirty |= state.feed(msg)
            now = time.monotonic()
            if dirty and now - last >= refresh_s:
                report, dirty, last = state.report(), False, now
                _publish(report, out_dir, on_update)
            if now >= deadline or (stop is not None and stop.is_set()):
                break
    except KeyboardInterrupt:  # Ctrl-C ends a follow; the final report below still gets written
        pass
    if dirty:
        report = state.report()
        _publish(report, out_dir, on_update)
    return report


def _publish(report: dict, out_dir: Path | None, on_update: Callable[[dict], None] | None) -> None:
    if out_dir is not None:
        write_report(report, out_dir)
    if on_update is not None:
        on_update(report)
