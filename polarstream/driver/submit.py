"""Each task as it goes out: a preset's template with the run's sampling on it (``task_payload``), and the
POST that hands it to the rollout server (``send``)."""

from __future__ import annotations

import math
import time

import httpx

from schemas import HarnessSpec, TaskRequest, derived_event_id


def task_payload(task: TaskRequest, task_id: str, samples: int, task_set: str, harness: HarnessSpec,
                 min_completion: float = 0.5, early_stop_at: float = 0.0, zero_signal: str = "mask") -> dict:
    """The TaskRequest sent for one train or eval task: the template ``task`` (its own workspace and
    evaluator) with the run's sampling. A group counts once ``min_completion`` of its samples (rounded down,
    at least 1) are usable; with ``early_stop_at`` > 0 the rollout server cancels the stragglers once that
    fraction (rounded up) is; a template that sets its own ``min_valid`` or ``early_stop`` keeps it.
    ``zero_signal``: what the trainer does with the group if it has no signal."""
    # its own event id (copies of one template share the template's, and consumers dedupe on it) and time
    req = task.model_copy(update={"event_id": derived_event_id("task", task_id), "created_at": time.time(),
                                  "task_id": task_id, "group_id": task_id, "num_samples": samples, "harness": harness,
                                  "task_set": task_set, "metadata": {**task.metadata, "source_task_id": task.task_id}})
    # a task that names its own minimum or early stop keeps it (at most the run's group size); the rest take the run's
    own = task.model_fields_set
    req.min_valid = min(task.min_valid, samples) if "min_valid" in own else max(1, int(min_completion * samples))
    req.early_stop = (min(task.early_stop, samples) if "early_stop" in own else
                      math.ceil(early_stop_at * samples) if early_stop_at > 0 else 0)
    req.early_stop = max(req.min_valid, req.early_stop) if req.early_stop else 0
    req.zero_signal = zero_signal
    return req.model_dump(mode="json")


def send(rollout_url: str, tasks: list[dict], one_by_one: bool = False) -> set[str]:
    """Post tasks to the rollout server; returns their group ids. ``one_by_one`` where some may be on
    polar.tasks already (a restarted driver's, a replacement): the server refuses those (409), which is no
    error."""
    if not one_by_one:
        httpx.post(f"{rollout_url}/tasks", json=tasks, timeout=60).raise_for_status()
    for t in tasks if one_by_one else ():
        r = httpx.post(f"{rollout_url}/tasks", json=[t], timeout=60)
        if r.status_code != 409:
            r.raise_for_status()
    return {t["group_id"] for t in tasks}
