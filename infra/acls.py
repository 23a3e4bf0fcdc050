"""Apply ``infra/acls.yaml`` (per-component Kafka ACLs) to a secured cluster.

``acl_bindings(settings)`` is pure: the table turned into confluent-kafka ``AclBinding`` objects for
settings' topic prefix. ``apply_acls`` creates them (creating an existing ACL is a no-op in Kafka, so
re-running is safe). The caller must be a super user (``admin``).
"""

from __future__ import annotations

import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from .errors import InfraError
from .settings import TOPICS, Settings

ACLS_FILE = Path(__file__).with_name("acls.yaml")
_KEYS = {"read", "write", "describe_configs", "groups", "owns"}


@lru_cache(maxsize=4)
def load_acl_table(path: Path = ACLS_FILE) -> dict[str, dict[str, list[str]]]:
    """principal -> {read, write, describe_configs, groups, owns}, validated against the known topics."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    table: dict[str, dict[str, list[str]]] = {}
    for name, body in (data.get("principals") or {}).items():
        body = body or {}
        unknown = set(body) - _KEYS
        if unknown:
            raise InfraError(f"{path}: principals.{name}: unknown keys {sorted(unknown)}; expected {sorted(_KEYS)}")
        entry = {k: [str(v) for v in body.get(k) or []] for k in _KEYS}
        for k in ("read", "write", "describe_configs"):
            bad = [t for t in entry[k] if t not in TOPICS]
            if bad:
                raise InfraError(f"{path}: principals.{name}.{k}: unknown topics {bad}; expected some of {list(TOPICS)}")
        table[name] = entry
    return table


def principals(path: Path = ACLS_FILE) -> list[str]:
    """The component principals of the table (each gets a SCRAM user)."""
    return list(load_acl_table(path))


def acl_bindings(settings: Settings, path: Path = ACLS_FILE) -> list[Any]:
    """Every ALLOW binding the table grants, with settings' topic prefix applied."""
    from confluent_kafka.admin import AclBinding, AclOperation as Op, AclPermissionType, ResourcePatternType as Pat
    from confluent_kafka.admin import ResourceType as Res

    out = []

    def allow(principal: str, res, name: str, pattern, op) -> None:
        out.append(AclBinding(res, name, pattern, f"User:{principal}", "*", op, AclPermissionType.ALLOW))

    for p, e in load_acl_table(path).items():
        for t in e["read"]:
            allow(p, Res.TOPIC, settings.topic(t), Pat.LITERAL, Op.READ)
        for t in e["write"]:
            allow(p, Res.TOPIC, settings.topic(t), Pat.LITERAL, Op.WRITE)
        for t in e["describe_configs"]:
            allow(p, Res.TOPIC, settings.topic(t), Pat.LITERAL, Op.DESCRIBE_CONFIGS)
        for g in e["groups"]:
            allow(p, Res.GROUP, g, Pat.PREFIXED, Op.READ)
        for own in e["owns"]:
            name = f"{settings.topic_prefix}{own}"
            allow(p, Res.TOPIC, name, Pat.PREFIXED, Op.ALL)
            allow(p, Res.GROUP, name, Pat.PREFIXED, Op.ALL)
    return out


def apply_acls(admin_settings: Settings, path: Path = ACLS_FILE, timeout: float = 30.0) -> int:
    """Create the table's ACLs for admin_settings' topic prefix; returns how many bindings it holds."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    bindings = acl_bindings(admin_settings, path)
    admin = AdminClient(admin_settings.kafka_config())
    for binding, fut in admin.create_acls(bindings, request_timeout=timeout).items():
        try:
            fut.result()
        except KafkaException as e:
            raise InfraError(f"creating ACL {binding} failed: {e.args[0].str()}") from None
    _wait_visible(admin, bindings, timeout)
    return len(bindings)


def _wait_visible(admin, bindings: list[Any], timeout: float) -> None:
    # CreateAcls returns once the controller committed them; the broker's authorizer applies them from
    # the metadata log a moment later. DescribeAcls is answered from that authorizer, so poll it:
    # "apply_acls returned" then means "the ACLs are enforced".
    from confluent_kafka.admin import AclBindingFilter, AclOperation, AclPermissionType, ResourcePatternType, ResourceType

    want = {(b.restype, b.name, b.resource_pattern_type, b.principal, b.operation) for b in bindings}
    anything = AclBindingFilter(ResourceType.ANY, None, ResourcePatternType.ANY, None, None, AclOperation.ANY,
                                AclPermissionType.ANY)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        have = {(b.restype, b.name, b.resource_pattern_type, b.principal, b.operation)
                for b in admin.describe_acls(anything, request_timeout=timeout).result()}
        if want <= have:
            return
        time.sleep(0.05)
    raise InfraError(f"{len(want - have)} ACLs not in force after {timeout:.0f}s")
