"""Shared steps of the end-to-end rollout tests."""

from __future__ import annotations

import re
import time

import httpx

from schemas import SessionEvent, TrainingGroup
from tests.streams.helpers import dedupe, read_topic


def wait_assigned(*nodes, timeout: float = 60) -> None:
    """Until every node owns at least one polar.sessions partition (the group has settled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(re.findall(rf"node {n.node_id}: assigned partitions \[\d", n.log_text()) for n in nodes):
            time.sleep(1.0)
            return
        time.sleep(0.2)
    raise AssertionError("nodes never shared the partitions:\n" + "\n".join(n.log_text()[-2000:] for n in nodes))


def submit(url: str, task: dict) -> dict:
    r = httpx.post(f"{url}/tasks", json=task, timeout=60)
    assert r.status_code == 202, r.text
    return r.json()


def wait_group(settings, group_id: str, timeout: float) -> TrainingGroup:
    """The (deduplicated) TrainingGroup of ``group_id`` from polar.groups."""
    def has(msgs):
        return any(m.key == group_id.encode() for m in msgs)

    msgs = read_topic(settings, "groups", until=has, timeout=timeout)
    groups, _ = dedupe([m for m in msgs if m.key == group_id.encode()], TrainingGroup)
    assert groups, f"no TrainingGroup for {group_id} within {timeout}s"
    from schemas import decode

    return decode(next(iter(groups.values())), TrainingGroup)


def session_events(settings, timeout: float = 10, until=lambda evs: False) -> list[SessionEvent]:
    from schemas import decode

    msgs = read_topic(settings, "session-events", until=lambda ms: until([decode(m.value, SessionEvent) for m in ms]), timeout=timeout)
    seen, _ = dedupe(msgs, SessionEvent)
    return [decode(v, SessionEvent) for v in seen.values()]
