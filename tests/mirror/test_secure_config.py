"""Secured named clusters and secured MM2 links, without starting anything (the live run is
tests/security/test_mirror_cli.py)."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from infra.clusters import cluster_admin, cluster_settings
from infra.discovery import home_ca_file, read_cluster_state
from infra.errors import InfraError
from infra.mirror import FILE_PROVIDER, MirrorMaker, externalize_secrets, mirror_properties, parse_properties
from infra.security import client_settings
from infra.settings import Settings


@pytest.fixture
def base(tmp_path) -> Settings:
    return Settings(data_dir=tmp_path, topic_prefix="exp.")


def test_secure_is_remembered_with_the_ports_and_brings_its_own_ca(base):
    eu = cluster_settings(base, "eu", create=True, secure=True)
    assert eu.secure and read_cluster_state(base.data_dir, "eu")["secure"] is True
    assert cluster_settings(base, "eu").secure  # later commands need no --secure
    assert eu.kafka_ca_file == str(base.data_dir / "clusters" / "eu" / "security" / "ca.pem")
    admin = cluster_admin(base, "eu")
    assert admin.kafka_username == "admin" and admin.kafka_auth()["security.protocol"] == "SASL_SSL"
    cluster_settings(base, "us", create=True)
    us = cluster_admin(base.model_copy(update={"kafka_username": "x", "kafka_ca_file": "/x.pem"}), "us")
    # A plaintext cluster's clients get no TLS/SASL, whatever the base settings carried.
    assert not us.secure and us.kafka_auth() == {}
    # Each secured cluster has its own CA and users (two datacenters share no secret).
    cluster_settings(base, "center", create=True, secure=True)
    center = cluster_admin(base, "center")
    assert center.kafka_password.get_secret_value() != admin.kafka_password.get_secret_value()
    assert center.kafka_ca_file != admin.kafka_ca_file


def test_home_cluster_that_is_secured_implies_its_ca(base):
    cluster_settings(base, "eu", create=True, secure=True)
    cluster_settings(base, "us", create=True)
    s = Settings(data_dir=base.data_dir, home_cluster="eu", kafka_username="gateway", kafka_password="pw")
    assert s.kafka_ca_file == home_ca_file(s.home_cluster, s.data_dir) == str(base.data_dir / "clusters" / "eu" / "security" / "ca.pem")
    assert s.kafka_auth()["security.protocol"] == "SASL_SSL"
    assert Settings(data_dir=base.data_dir, home_cluster="us").kafka_ca_file == ""
    assert Settings(data_dir=base.data_dir, home_cluster="eu", kafka_ca_file="/mine.pem").kafka_ca_file == "/mine.pem"


def test_a_cluster_with_plaintext_data_cannot_become_secured(base):
    cluster_settings(base, "eu", create=True)
    assert cluster_settings(base, "eu", create=True, secure=True).secure  # never started: fine
    cluster_settings(base, "us", create=True)
    data = base.data_dir / "clusters" / "us" / "kafka" / "data"
    data.mkdir(parents=True)
    (data / "meta.properties").write_text("cluster.id=x\n")
    with pytest.raises(InfraError, match=r"cluster 'us' holds plaintext data .* cannot become secured"):
        cluster_settings(base, "us", create=True, secure=True)


def test_secrets_move_to_a_0600_file_referenced_through_the_file_provider(base, tmp_path):
    cluster_settings(base, "eu", create=True, secure=True)
    eu = cluster_admin(base, "eu")
    props = mirror_properties("eu", "e:1", "center", "c:2", base, clients={"eu": eu})
    secret_file = tmp_path / "mirror" / "eu-center.secrets.properties"
    out, secrets = externalize_secrets(props, secret_file)
    password = eu.kafka_password.get_secret_value()
    assert password in props["eu.sasl.jaas.config"] and list(secrets) == ["eu.sasl.jaas.config"]
    assert out["eu.sasl.jaas.config"] == f"${{file:{secret_file}:eu.sasl.jaas.config}}"
    assert out["config.providers"] == "file" and out["config.providers.file.class"] == FILE_PROVIDER
    assert not any(password in v for v in out.values())
    assert externalize_secrets(out, secret_file) == (out, {})  # idempotent: references are no secrets
    plain = mirror_properties("eu", "e:1", "center", "c:2", base)
    assert externalize_secrets(plain, secret_file) == (plain, {})  # nothing secured: file unchanged

    mm = MirrorMaker(base.model_copy(update={"data_dir": tmp_path}), region="eu", center="center")
    assert mm.secrets_file == secret_file
    mm.props, mm.secrets = out, secrets
    mm.root.mkdir(parents=True, exist_ok=True)
    mm.prepare()
    assert os.stat(secret_file).st_mode & 0o077 == 0
    assert parse_properties(secret_file.read_text()) == secrets  # what FileConfigProvider will read
    assert password not in mm.config_file.read_text()


def test_mirror_print_config_of_secured_clusters_shows_no_secret(tmp_path):
    from polarstream.cli import app

    base = Settings(data_dir=tmp_path)
    for n in ("eu", "center"):
        cluster_settings(base, n, create=True, secure=True)
    eu_gateway = client_settings(cluster_admin(base, "eu"), "gateway")  # the credentials exist by now
    res = CliRunner().invoke(app, ["infra", "mirror", "--from", "eu", "--to", "center", "--print-config"],
                             env={"POLAR_DATA_DIR": str(tmp_path)})
    assert res.exit_code == 0, res.output
    props = parse_properties(res.output)
    assert props["eu.security.protocol"] == props["center.security.protocol"] == "SASL_SSL"
    assert props["center.sasl.jaas.config"] == f"${{file:{tmp_path}/mirror/eu-center.secrets.properties:center.sasl.jaas.config}}"
    admin_pw = cluster_admin(base, "eu").kafka_password.get_secret_value()
    assert admin_pw not in res.output and eu_gateway.kafka_password.get_secret_value() not in res.output


def test_acls_on_a_plaintext_cluster_is_a_clear_error(tmp_path):
    from polarstream.cli import app

    cluster_settings(Settings(data_dir=tmp_path), "eu", create=True)
    res = CliRunner().invoke(app, ["infra", "acls", "--cluster", "eu"], env={"POLAR_DATA_DIR": str(tmp_path)})
    assert res.exit_code == 1 and "cluster 'eu' is not secured" in res.output
