"""Pure parts of the secured setup: TLS material, credentials, broker/client/MM2 settings, the ACL table."""

from __future__ import annotations

import stat

import pytest
from pydantic import SecretStr

from infra.acls import acl_bindings, load_acl_table, principals
from infra.errors import InfraError
from infra.mirror import mirror_properties
from infra.security import (ADMIN, client_settings, ensure_credentials, ensure_tls, mirror_client_properties,
                            scram_format_args, secure_broker_properties, security_files)
from infra.settings import Settings


def test_tls_material_is_valid_for_loopback_and_private(tmp_path):
    from cryptography import x509

    files = security_files(Settings(data_dir=tmp_path))
    ensure_tls(files)
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    broker = x509.load_pem_x509_certificates(files.broker.read_bytes())[0]
    broker.verify_directly_issued_by(ca)
    sans = broker.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {"127.0.0.1"}
    assert "localhost" in sans.get_values_for_type(x509.DNSName)
    assert b"PRIVATE KEY" in files.broker.read_bytes()
    for key in (files.broker, files.ca_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    before = files.broker.read_bytes()
    ensure_tls(files)
    assert files.broker.read_bytes() == before  # idempotent: an existing CA is never replaced


def test_credentials_are_created_once_per_principal(tmp_path):
    files = security_files(Settings(data_dir=tmp_path))
    first = ensure_credentials(files, ["gateway"])
    assert set(first["kafka"]) == {ADMIN, "gateway"} and stat.S_IMODE(files.credentials.stat().st_mode) == 0o600
    second = ensure_credentials(files, ["gateway", "trainer"])
    assert second["kafka"]["gateway"] == first["kafka"]["gateway"] and "trainer" in second["kafka"]
    assert second["s3"]["writer"][0] != second["s3"]["reader"][0]
    args = scram_format_args({"gateway": "pw"})
    assert args == ["--add-scram", "SCRAM-SHA-512=[name=gateway,password=pw]"]


def test_broker_properties_secure_every_listener(tmp_path):
    s = Settings(data_dir=tmp_path, kafka_port=19092, kafka_controller_port=19093)
    props = secure_broker_properties(s, security_files(s), "adminpw")
    protocols = dict(kv.split(":") for kv in props["listener.security.protocol.map"].split(","))
    assert protocols == {"SECURE": "SASL_SSL", "CONTROLLER": "SSL"}  # no plaintext listener at all
    assert props["listener.name.controller.ssl.client.auth"] == "required"
    assert props["allow.everyone.if.no.acl.found"] == "false"
    assert props["super.users"] == "User:admin;User:CN=polar-broker"
    assert props["advertised.listeners"] == "SECURE://127.0.0.1:19092"


def test_client_settings_map_to_librdkafka_and_hide_the_password(tmp_path):
    s = Settings(data_dir=tmp_path)
    assert "security.protocol" not in s.kafka_config()  # default: plaintext, unchanged
    c = client_settings(s, "gateway", password="s3cret-pw")
    cfg = c.kafka_config()
    assert (cfg["security.protocol"], cfg["sasl.mechanism"], cfg["sasl.username"], cfg["sasl.password"]) == \
        ("SASL_SSL", "SCRAM-SHA-512", "gateway", "s3cret-pw")
    assert cfg["ssl.ca.location"].endswith("security/ca.pem")
    assert "s3cret-pw" not in repr(c) and "s3cret-pw" not in str(c.model_dump(mode="json"))
    assert c.s3_secret_key not in repr(c) and c.session_secret not in repr(c)  # repr=False on the others
    env = Settings(data_dir=tmp_path, kafka_username="u", kafka_password="p")  # env / YAML give plain strings
    assert isinstance(env.kafka_password, SecretStr) and env.kafka_config()["security.protocol"] == "SASL_PLAINTEXT"
    with pytest.raises(KeyError, match="no credentials"):
        client_settings(s, "nobody")


def test_mirror_links_use_tls_and_sasl(tmp_path):
    base = Settings(data_dir=tmp_path)
    eu = client_settings(base, "admin", password='pa"ss')
    props = mirror_properties("eu", "127.0.0.1:1", "center", "127.0.0.1:2", base, clients={"eu": eu, "center": eu})
    for alias in ("eu", "center"):
        assert props[f"{alias}.security.protocol"] == "SASL_SSL"
        assert props[f"{alias}.ssl.truststore.type"] == "PEM"
        assert 'username="admin" password="pa\\"ss";' in props[f"{alias}.sasl.jaas.config"]
    assert "eu.security.protocol" not in mirror_properties("eu", "a:1", "center", "b:2", base)
    assert mirror_client_properties("x", base) == {}


def test_acl_table_grants_exactly_what_components_do():
    table = load_acl_table()
    assert set(principals()) == {"gateway", "streams", "trainer", "rollout"}
    assert "groups" not in table["gateway"]["read"] and "calls" not in table["trainer"]["write"]
    s = Settings(topic_prefix="exp1.")
    grants = {(b.principal, b.operation.name, b.name) for b in acl_bindings(s)}
    assert ("User:gateway", "WRITE", "exp1.polar.calls") in grants
    assert ("User:trainer", "READ", "exp1.polar.groups") in grants
    assert ("User:streams", "ALL", "exp1.polarstream-streams") in grants  # its Faust app id prefix
    assert not any(p == "User:gateway" and n == "exp1.polar.groups" for p, _, n in grants)


def test_acl_table_errors_name_the_place(tmp_path):
    bad = tmp_path / "acls.yaml"
    bad.write_text("principals:\n  gateway:\n    read: [callz]\n")
    with pytest.raises(InfraError, match=r"principals.gateway.read: unknown topics \['callz'\]"):
        load_acl_table(bad)
    bad.write_text("principals:\n  gateway:\n    reed: [calls]\n")
    with pytest.raises(InfraError, match="unknown keys"):
        load_acl_table(bad)
