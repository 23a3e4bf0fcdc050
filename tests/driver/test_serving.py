"""The version the engine serves (polarstream/driver/serving.py): learned from polar.policy, with the engine
asked only while the topic is ahead of what it was last seen serving."""

from __future__ import annotations

import pytest

from polarstream.driver.serving import Served


class Engine:
    """GET /policy_version of an engine that loads each version some requests after it is published."""

    def __init__(self):
        self.version, self.asked = 0, 0

    def __call__(self, url: str) -> int:
        self.asked += 1
        return self.version


def test_a_step_waits_for_the_sync_and_the_engine_is_asked_only_until_it_serves_the_topics_version():
    engine = Engine()
    served = Served("http://engine", probe=engine)
    assert [served.version(0) for _ in range(5)] == [0] * 5 and engine.asked == 0  # nothing trained: the start model
    # version 1 is on polar.policy before the trainer loaded it into the engine: the gate stays at 0
    assert [served.version(1) for _ in range(3)] == [0, 0, 0] and engine.asked == 3
    engine.version = 1  # the sync is done
    assert served.version(1) == 1 and engine.asked == 4
    assert [served.version(1) for _ in range(100)] == [1] * 100 and engine.asked == 4  # the topic says it now
    engine.version = -1  # version 2 is out; an engine that cannot say does not lower what it was seen serving
    assert served.version(2) == 1 and engine.asked == 5
    engine.version = 2
    assert served.version(2) == 2 and served.version(2) == 2 and engine.asked == 6


def test_a_restarted_trainers_resync_is_asked_about_again():
    """The trainer, started again, hands the engines its checkpoint's weights (maybe older): no record says so."""
    engine = Engine()
    served = Served("http://engine", probe=engine)
    engine.version = 3
    assert served.version(3) == 3
    served.forget()
    engine.version = 2  # the checkpoint's version, until the next sync
    assert served.version(3) == 2 and served.version(3) == 2 and engine.asked == 3


@pytest.mark.integration
def test_a_lora_runs_served_version_is_the_gateways_stamp(polar_settings, gateway_factory):
    """Issue 64: a LoRA run's engine keeps reporting its base weights; the gate reads the gateway's stamp."""
    import httpx

    from polarstream.driver.serving import stamped

    gateway = gateway_factory(polar_settings, "http://127.0.0.1:9")  # no call reaches the engine here
    token = polar_settings.admin_token
    assert stamped(gateway.url, token) == 0
    httpx.post(f"{gateway.url}/admin/policy_version", json={"version": 3},
               headers={"authorization": f"Bearer {token}"}).raise_for_status()
    assert stamped(gateway.url, token) == 3
    assert stamped(gateway.url, "not-the-token") == -1 and stamped("http://127.0.0.1:9", token) == -1
    served = Served(gateway.url, probe=lambda url: stamped(url, token))
    assert served.version(4) == 3  # version 4 published, not yet stamped
