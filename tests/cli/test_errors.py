"""``explain``: one line for each expected failure, None (the traceback shows) for anything else."""

from __future__ import annotations

import errno

import httpx
import pydantic
import pytest
import yaml
from confluent_kafka import KafkaError, KafkaException

from infra.errors import InfraError
from infra.settings import Settings
from polarstream.errors import explain


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test hands every kind to explain
        return e
    raise AssertionError("did not raise")


def test_files_yaml_json_and_settings(tmp_path):
    assert explain(FileNotFoundError(errno.ENOENT, "No such file or directory", "/x.yaml")) == \
        "no such file or directory: /x.yaml"
    assert explain(IsADirectoryError(errno.EISDIR, "Is a directory", "/tmp")) == "is a directory: /tmp"
    assert explain(FileNotFoundError("model 'x': no such directory")) == "model 'x': no such directory"
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    message = explain(_raised(lambda: yaml.safe_load((tmp_path / "bad.yaml").open())))
    assert message.startswith(f"malformed YAML in {tmp_path / 'bad.yaml'}, line 2, column 1: ")
    assert explain(_raised(lambda: __import__("json").loads("{"))).startswith("malformed JSON: ")
    (tmp_path / "s.yaml").write_text("kafka_prt: 1\n")
    assert explain(_raised(lambda: Settings(config=str(tmp_path / "s.yaml")))) == \
        "invalid Settings: kafka_prt: Extra inputs are not permitted"


def test_services_and_credentials():
    assert explain(InfraError("cannot reach Kafka at h:1")) == "cannot reach Kafka at h:1"
    assert explain(OSError(errno.EADDRINUSE, "Address already in use")).startswith("address already in use")
    refused = _raised(lambda: httpx.get("http://127.0.0.1:9/x", timeout=2))
    assert explain(refused).startswith("cannot reach http://127.0.0.1:9/x (")
    request = httpx.Request("GET", "http://h/x")
    denied = httpx.HTTPStatusError("401", request=request, response=httpx.Response(401, request=request))
    assert explain(denied) == "http://h/x refused the credentials (HTTP 401)"
    auth = KafkaException(KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error: bad password"))
    assert explain(auth).startswith("kafka refused the credentials (SASL authentication error: bad password)")
    acl = KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "denied"))
    assert "refused access" in explain(acl) and "infra acls" in explain(acl)
    down = KafkaException(KafkaError(KafkaError._TRANSPORT, "Broker transport failure"))
    assert "polarstream infra up" in explain(down)


class Record(pydantic.BaseModel):
    n: int


@pytest.mark.parametrize("bug", [
    KeyError("x"), ValueError("x"), RuntimeError("x"), TypeError("x"),
    _raised(lambda: Record(n="x")),  # a record the code built wrong, not the user's settings
    KafkaException(KafkaError(KafkaError._STATE, "x")),
])
def test_anything_else_is_a_bug(bug):
    assert explain(bug) is None
