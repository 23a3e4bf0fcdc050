"""Fan-out: one TaskRequest becomes ``num_samples`` SessionAssigned records, each with its own key.

Session ids and event ids are deterministic (``<group_id>.s<i>``), so a re-published fan-out is
recognisably the same sessions, and every consumer can dedupe on event_id.

A task may mix harnesses within its group: ``harness = {"name": "mix", "config": {"harnesses": [spec,
spec, ...]}}`` gives sample ``i`` the spec ``i mod n`` (so one GRPO group compares, say, Qwen Code and pi
rollouts of the same task). Each session embeds the task with its own resolved harness.

Each key carries its run (``run``: the run's topic prefix, ``settings.topic_prefix``), so a gateway shared
by several runs records the session's calls in that run's topics and stamps them with that run's policy
(docs/gateway.md, "LoRA runs and several runs on one gateway"); '' (the default prefix) adds no claim.
"""

from __future__ import annotations

from pydantic import ValidationError

from schemas import HarnessSpec, SessionAssigned, TaskRequest, derived_event_id
from schemas.session_keys import DEFAULT_KEY_TTL_S, mint_session_key


class FanOutError(ValueError):
    """A task that cannot be fanned out; the message names the field."""


def session_id(task: TaskRequest, sample_index: int) -> str:
    """Id of sample ``sample_index`` of ``task`` (attempt 0; re-runs append ``.a<attempt>``)."""
    return f"{task.group_id}.s{sample_index}"


def harness_for(task: TaskRequest, sample_index: int) -> HarnessSpec:
    """The harness of one sample: the task's own, or its turn in a ``mix``."""
    if task.harness.name != "mix":
        return task.harness
    options = task.harness.config.get("harnesses")
    if not isinstance(options, list) or not options:
        raise FanOutError("harness.config.harnesses: a 'mix' needs a non-empty list of harness specs")
    raw = options[sample_index % len(options)]
    try:
        spec = HarnessSpec.model_validate(raw)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"])
        raise FanOutError(f"harness.config.harnesses[{sample_index % len(options)}].{where}: {err['msg']}") from None
    if spec.name == "mix":
        raise FanOutError("harness.config.harnesses: a 'mix' cannot contain another 'mix'")
    return spec


def fan_out(task: TaskRequest, secret: str, key_ttl_s: float = DEFAULT_KEY_TTL_S, *, run: str = "") -> list[SessionAssigned]:
    """The task's sessions, sample 0..num_samples-1, attempt 0, each with a key scoped to it (and to ``run``)."""
    out = []
    for i in range(task.num_samples):
        sid = session_id(task, i)
        spec = harness_for(task, i)
        sample_task = task if spec is task.harness else task.model_copy(update={"harness": spec})
        key = mint_session_key(sid, secret, group_id=task.group_id, task_id=task.task_id, sample_index=i, attempt=0,
                               harness=spec.name, ttl_s=key_ttl_s, run=run)
        out.append(SessionAssigned(event_id=derived_event_id("assigned", sid, 0), session_id=sid, group_id=task.group_id,
                                   task_id=task.task_id, sample_index=i, attempt=0, session_key=key, task=sample_task))
    return out


def cancel_marker(task: TaskRequest, reason: str) -> TaskRequest:
    """The task re-published with ``cancelled`` set: nodes stop its sessions (see gateway/node)."""
    return task.model_copy(update={"cancelled": reason or "cancelled", "event_id": derived_event_id("cancel", task.task_id)})
