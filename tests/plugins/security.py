"""A secured stack for the security tests (tests/security/).

- ``secure_infra`` (session): Kafka with SASL_SSL/SCRAM + ACLs, the writer S3 server and the read-only
  S3 server on free ports under a temp dir; ``.stack``, ``.settings`` (the admin view: Kafka as
  ``admin``, S3 as the checkpoint writer).
- ``secure_settings`` (function): those admin settings with a unique topic prefix whose topics and
  ACLs exist (topics deleted afterwards).
- ``principal_settings(settings, "gateway")``: the same settings as one component principal.
"""

from __future__ import annotations

import uuid

import pytest

from infra.acls import apply_acls
from infra.security import client_settings
from infra.settings import Settings
from infra.topics import delete_topics, ensure_topics
from tests.plugins.infra import Infra, running_stack


@pytest.fixture(scope="session")
def secure_infra(tmp_path_factory) -> Infra:
    """The secured stack for the whole session, stopped at its end."""
    with running_stack(tmp_path_factory.mktemp("secure-infra"), secure=True) as stack:
        yield Infra(stack)


@pytest.fixture
def secure_settings(secure_infra: Infra, tmp_path) -> Settings:
    """Admin settings for one test: own topic prefix (topics + ACLs applied), storage prefix, data dir."""
    tag = uuid.uuid4().hex[:10]
    settings = secure_infra.settings.model_copy(update={
        "topic_prefix": f"s{tag}.", "storage_url": f"s3://{secure_infra.settings.s3_bucket}/tests/{tag}",
    })
    ensure_topics(settings)
    apply_acls(settings)
    yield settings
    try:
        delete_topics(settings, timeout=10)
    except Exception:  # cleanup only
        pass


def principal_settings(settings: Settings, principal: str) -> Settings:
    """``settings`` (same prefix, same stack) as one component principal."""
    return client_settings(settings, principal)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if "secure_infra" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)
