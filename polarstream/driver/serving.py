"""Which policy version the engine serves, as a step's gate needs it, and the engine's busy seconds.

A step goes out on-policy only once the engine serves the weights trained on the previous one
(schedule.py). polar.policy, which the Watcher reads anyway, says which version the trainer trained; it
cannot say alone that the engine serves it: the trainer publishes a PolicyVersion *before* it loads those
weights into the engines (trainer/sync/syncer.py: publish, then sync), and a sync can fail and leave the
engines a version behind until the next one. So ``Served`` asks the engine (GET /policy_version) only
while the topic is ahead of what the engine was last seen serving: at start (a resumed driver), for the
moments between a PolicyVersion and its sync, and after the driver started the trainer again (a resumed
trainer hands the engines the weights of its checkpoint, which may be older). Otherwise it is the
topic's, without a request: the run's engines only move forward, since only the trainer loads weights
into them.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def node_stage_totals(gateway_url: str | None) -> dict[str, list[float]] | None:
    """The node's summed session stage times (its GET /metrics: ``polar_node_stage_seconds`` and
    ``_sessions``) as ``"<sandbox>.<stage>" -> [seconds, sessions]``, or None when it cannot say."""
    if not gateway_url:
        return None
    try:
        text = httpx.get(f"{gateway_url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            which = {"polar_node_stage_seconds_total": 0, "polar_node_stage_sessions_total": 1}.get(sample.name)
            if which is not None:
                key = f"{sample.labels.get('sandbox', '?')}.{sample.labels.get('stage', '?')}"
                out.setdefault(key, [0.0, 0.0])[which] += sample.value
    return out


def serving(engine_url: str) -> int:
    """The policy version the engine serves now (-1 while it cannot say)."""
    try:
        return int(httpx.get(f"{engine_url}/policy_version", timeout=5).json()["policy_version"])
    except (httpx.HTTPError, KeyError, ValueError):
        return -1


def stamped(gateway_url: str, admin_token: str = "", run: str = "") -> int:
    """The policy version the gateway stamps on ``run``'s calls (-1 while it cannot say). A LoRA run's engines
    keep their base weights and report that version; what a call is sampled with is the adapter the gateway
    routes it to, stamped with its version after the trainer loaded it into every engine."""
    try:
        r = httpx.get(f"{gateway_url}/admin/policy_version", params={"run": run} if run else None, timeout=5,
                      headers={"authorization": f"Bearer {admin_token}"})
        return int(r.json()["version"]) if r.status_code == 200 else -1
    except (httpx.HTTPError, KeyError, ValueError, TypeError):
        return -1


def engine_busy_s(engine_url: str) -> float | None:
    """Seconds the engine has spent generating (its GET /stats), or None when it cannot say."""
    try:
        return float(httpx.get(f"{engine_url}/stats", timeout=5).json()["busy_s"])
    except (httpx.HTTPError, KeyError, ValueError, TypeError):
        return None


class Served:
    """The version the engine serves, from the trained version on polar.policy (module docstring)."""

    def __init__(self, engine_url: str, probe=serving):
        self.engine_url, self.probe = engine_url, probe
        self.seen = 0  # the newest version the engine was seen serving (0: the model it started with)
        self.probes = 0  # requests made (the tests count them)

    def version(self, trained: int) -> int:
        """What the engine serves of the versions up to ``trained`` (the newest on polar.policy)."""
        if trained > self.seen:  # the topic is ahead: has the engine loaded it yet?
            self.probes += 1
            self.seen = max(self.seen, min(trained, self.probe(self.engine_url)))
        return min(trained, self.seen)

    def forget(self) -> None:
        """Ask the engine again next time: something the topic does not show may have changed what it
        serves (a restarted trainer's resync)."""
        self.seen = 0
