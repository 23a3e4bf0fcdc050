"""The secured broker: every component principal can do its job and nothing else (infra/acls.yaml),
and clients without valid credentials get nowhere."""

from __future__ import annotations

import asyncio

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from infra.security import AccessDenied
from producers.consumer import RecordConsumer
from producers.publisher import Publisher, PublishError
from schemas import CallRecorded, PolicyVersion, SessionAssigned, SessionEvent, TaskRequest, TrainingGroup, Trajectory
from tests.plugins.security import principal_settings

TASK = TaskRequest(task_id="t1", instruction="do it", num_samples=1, min_valid=1)
RECORDS = {
    "tasks": TASK,
    "sessions": SessionAssigned(session_id="t1.s0", group_id="t1", task_id="t1", sample_index=0, session_key="k", task=TASK),
    "calls": CallRecorded(session_id="t1.s0", call_index=0, provider="engine", prompt_ids=[1, 2], completion_ids=[3],
                          completion_logprobs=[-0.5]),
    "session-events": SessionEvent(session_id="t1.s0", kind="finished", status="ok", reward=1.0, num_calls=1),
    "policy": PolicyVersion(model="tiny", version=1, checkpoint_url="s3://polarstream/x", step=1),
}


def publish(settings, record) -> None:
    async def go():
        async with Publisher(settings, delivery_timeout_s=15) as pub:
            await pub.publish(record)
    asyncio.run(go())


def read(settings, topic: str, group: str, want: int = 1, timeout: float = 20.0) -> list:
    """Records of ``topic`` read as ``settings``' principal (AccessDenied when refused)."""
    import time

    out, deadline = [], time.monotonic() + timeout
    with RecordConsumer(settings, topics=[topic], group_id=group) as c:
        while len(out) < want and time.monotonic() < deadline:
            out += c.poll(0.5)
        c.commit()
    return out


def test_each_principal_can_do_its_job(secure_settings):
    s = secure_settings
    gateway, streams, trainer, rollout = (principal_settings(s, p) for p in ("gateway", "streams", "trainer", "rollout"))
    publish(rollout, RECORDS["tasks"])
    publish(rollout, RECORDS["sessions"])
    assert [r.record.session_id for r in read(gateway, "sessions", "polar-nodes")] == ["t1.s0"]
    assert [r.record.task_id for r in read(gateway, "tasks", "polar-node-n1-tasks-x")] == ["t1"]
    publish(gateway, RECORDS["calls"])
    publish(gateway, RECORDS["session-events"])
    assert [r.record.kind for r in read(rollout, "session-events", "polar-rollout-1")] == ["finished"]
    assert len(read(streams, "calls", f"{s.topic_prefix}polarstream-streams")) == 1
    traj = Trajectory(session_id="t1.s0", group_id="t1", task_id="t1", reward=1.0, traces=[])
    publish(streams, traj)
    publish(streams, TrainingGroup(group_id="t1", task_id="t1", trajectories=[traj], advantages=[0.0]))
    assert len(read(trainer, "groups", "polar-trainer")) == 1
    publish(trainer, RECORDS["policy"])


@pytest.mark.parametrize("principal,topic", [("trainer", "calls"), ("gateway", "policy"), ("streams", "tasks"),
                                             ("rollout", "calls")])
def test_writes_outside_the_table_are_refused(secure_settings, principal, topic):
    with pytest.raises(PublishError) as e:
        publish(principal_settings(secure_settings, principal), RECORDS[topic])
    assert e.value.code == "TOPIC_AUTHORIZATION_FAILED"
    assert "authorization failed" in str(e.value).lower() and "\n" not in str(e.value)


@pytest.mark.parametrize("principal,topic,group", [
    ("gateway", "groups", "polar-node-spy"),       # the example: a gateway reading polar.groups
    ("trainer", "calls", "polar-trainer"),
    ("rollout", "calls", "polar-rollout-spy"),
    ("gateway", "sessions", "polar-trainer"),      # its topic, but another component's consumer group
])
def test_reads_outside_the_table_are_refused(secure_settings, principal, topic, group):
    publish(secure_settings, RECORDS.get(topic) or RECORDS["calls"])  # admin: something is there to read
    with pytest.raises(AccessDenied) as e:
        read(principal_settings(secure_settings, principal), topic, group)
    msg = str(e.value)
    assert f"principal {principal!r} may not read" in msg and "AUTHORIZATION_FAILED" in msg and "\n" not in msg


def _probe(config: dict) -> list[str]:
    """Error names the client reported while failing to fetch metadata (it must fail: no topic is listed)."""
    errors: list[str] = []
    admin = AdminClient({**config, "error_cb": lambda err: errors.append(err.name())})
    with pytest.raises(KafkaException):
        admin.list_topics(timeout=4)
    admin.poll(0.5)  # serves error_cb
    return errors


def test_plaintext_and_wrong_password_clients_are_refused(secure_settings):
    gw = principal_settings(secure_settings, "gateway")
    # Plaintext: the TLS listener drops the connection before any Kafka request is answered.
    _probe({"bootstrap.servers": gw.kafka_bootstrap, "log_level": 0})
    # TLS without SASL: the handshake succeeds but there is no identity, so the broker hangs up.
    _probe({**gw.kafka_config(), "security.protocol": "SSL", "log_level": 0})
    wrong = principal_settings(secure_settings, "gateway").model_copy(update={"kafka_password": type(gw.kafka_password)("nope")})
    assert "_AUTHENTICATION" in _probe({**wrong.kafka_config(), "log_level": 0})
    unknown = wrong.model_copy(update={"kafka_username": "mallory"})
    assert "_AUTHENTICATION" in _probe({**unknown.kafka_config(), "log_level": 0})
    # An untrusted certificate authority: the client refuses the broker.
    untrusted = {**gw.kafka_config(), "ssl.ca.location": "/etc/ssl/certs/ca-certificates.crt", "log_level": 0}
    assert "_SSL" in _probe(untrusted) or "_TRANSPORT" in _probe(untrusted)


def test_secrets_stay_out_of_settings_repr_and_dumps(secure_settings):
    gw = principal_settings(secure_settings, "gateway")
    password = gw.kafka_password.get_secret_value()
    assert len(password) >= 24
    assert password not in repr(gw) and password not in str(gw.model_dump(mode="json"))
    assert gw.kafka_config()["sasl.password"] == password  # only the client config sees it


def test_a_publisher_with_a_wrong_password_says_why_once(secure_settings, caplog):
    gw = principal_settings(secure_settings, "gateway")
    wrong = gw.model_copy(update={"kafka_password": type(gw.kafka_password)("not-the-password")})

    async def go():
        async with Publisher(wrong, delivery_timeout_s=4) as pub:
            await pub.publish(RECORDS["calls"])

    with caplog.at_level("ERROR", logger="producers.publisher"), pytest.raises(PublishError):
        asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records if "refused the credentials" in r.getMessage()]
    assert len(lines) == 1 and "'gateway'" in lines[0] and "not-the-password" not in caplog.text
