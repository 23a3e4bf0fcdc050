"""The secured local stack: TLS material, SCRAM users, broker listener settings, client settings.

``polarstream infra up --secure`` keeps everything under ``<data_dir>/security``:

- ``ca.pem`` / ``ca.key``: a local certificate authority (clients trust ``ca.pem``);
- ``broker.pem``: the broker's private key followed by its certificate (Kafka's PEM keystore format),
  valid for 127.0.0.1 and localhost, subject ``CN=polar-broker``;
- ``credentials.yaml`` (mode 0600): one random SCRAM password per principal (infra/acls.yaml) and the
  two S3 identities (writer, reader).

Listeners: clients use ``SECURE`` (SASL_SSL, SCRAM-SHA-512). The KRaft controller listener uses
mutual TLS: SCRAM users live in the metadata log, which the controller must already serve before it
could check a SCRAM login, so KRaft cannot use SCRAM there. Only a holder of a certificate signed by
the local CA gets in, and the broker's own certificate principal is a super user (with ``admin``).
Nothing here is ever logged: passwords are SecretStr in Settings and 0600 on disk.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import SecretStr

from .settings import Settings

MECHANISM = "SCRAM-SHA-512"
BROKER_PRINCIPAL = "User:CN=polar-broker"
ADMIN = "admin"
S3_WRITER, S3_READER = "polar-ckpt-writer", "polar-ckpt-reader"


@dataclass(frozen=True)
class SecurityFiles:
    """Paths of the TLS material and credentials of one secured stack."""

    root: Path

    ca = property(lambda self: self.root / "ca.pem")
    ca_key = property(lambda self: self.root / "ca.key")
    broker = property(lambda self: self.root / "broker.pem")
    credentials = property(lambda self: self.root / "credentials.yaml")


def security_files(settings: Settings) -> SecurityFiles:
    """Where the secured stack of ``settings`` keeps its material."""
    return SecurityFiles(settings.data_dir / "security")


# ------------------------------------------------------------------------------------- TLS material


def _write_private(path: Path, data: bytes) -> None:
    # Created 0600 from the start: a key must never be readable, not even for a moment.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _cert(subject: str, public_key, issuer: str, signing_key, *, ca: bool, sans: list | None = None, days: int = 825):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.timezone.utc)
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
         .public_key(public_key).serial_number(x509.random_serial_number())
         .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        # Both: the broker serves TLS and is a TLS client of its own controller listener (mutual TLS).
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return b.sign(signing_key, hashes.SHA256())


def ensure_tls(files: SecurityFiles, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> None:
    """Create the CA and the broker certificate unless they exist (idempotent)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    files.root.mkdir(parents=True, exist_ok=True)
    if files.ca.exists() and files.broker.exists():
        return
    pem, nokey = serialization.Encoding.PEM, serialization.NoEncryption()
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _cert("polarstream local CA", ca_key.public_key(), "polarstream local CA", ca_key, ca=True, days=3650)
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.IPAddress(ipaddress.ip_address(h)) if h.replace(".", "").isdigit() else x509.DNSName(h) for h in hosts]
    cert = _cert("polar-broker", key.public_key(), "polarstream local CA", ca_key, ca=False, sans=sans)
    # Kafka's PEM keystore: an unencrypted PKCS#8 key, then the certificate chain.
    keystore = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, nokey) + cert.public_bytes(pem)
    _write_private(files.ca_key, ca_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, nokey))
    _write_private(files.broker, keystore)
    files.ca.write_bytes(ca_cert.public_bytes(pem))


# ------------------------------------------------------------------------------------- credentials


def ensure_credentials(files: SecurityFiles, principals: list[str]) -> dict[str, Any]:
    """``{"kafka": {principal: password}, "s3": {"writer": [key, secret], "reader": [...]}}``, created once.

    Principals added to acls.yaml later get a password on the next call; existing ones keep theirs.
    """
    files.root.mkdir(parents=True, exist_ok=True)
    data = yaml.safe_load(files.credentials.read_text()) if files.credentials.exists() else {}
    data = data or {}
    kafka = data.setdefault("kafka", {})
    changed = not files.credentials.exists()
    for p in [ADMIN, *principals]:
        if p not in kafka:
            kafka[p], changed = secrets.token_urlsafe(24), True
    s3 = data.setdefault("s3", {})
    for role, ident in (("writer", S3_WRITER), ("reader", S3_READER)):
        if role not in s3:
            s3[role], changed = [ident, secrets.token_urlsafe(24)], True
    if changed:
        _write_private(files.credentials, yaml.safe_dump(data).encode())
    return data


def load_credentials(settings: Settings) -> dict[str, Any]:
    """The secured stack's credentials file ({} when there is none yet)."""
    path = security_files(settings).credentials
    return (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}


def scram_format_args(kafka_users: dict[str, str]) -> list[str]:
    """``kafka-storage format`` arguments that create every SCRAM user at format time (KRaft)."""
    out = []
    for name, password in kafka_users.items():
        out += ["--add-scram", f"{MECHANISM}=[name={name},password={password}]"]
    return out


# ------------------------------------------------------------------------------------- broker


def secure_broker_properties(settings: Settings, files: SecurityFiles, admin_password: str) -> dict[str, str]:
    """server.properties entries that turn the single node into a SASL_SSL + mutual-TLS, ACL'd broker."""
    port, cport = settings.kafka_port, settings.kafka_controller_port
    jaas = f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{ADMIN}" password="{admin_password}";'
    return {
        "listeners": f"SECURE://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}",
        "advertised.listeners": f"SECURE://127.0.0.1:{port}",
        "listener.security.protocol.map": "SECURE:SASL_SSL,CONTROLLER:SSL",
        "inter.broker.listener.name": "SECURE",
        "sasl.enabled.mechanisms": MECHANISM,
        "sasl.mechanism.inter.broker.protocol": MECHANISM,
        "listener.name.secure.scram-sha-512.sasl.jaas.config": jaas,
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(files.broker),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(files.ca),
        "listener.name.controller.ssl.client.auth": "required",
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "super.users": f"User:{ADMIN};{BROKER_PRINCIPAL}",
        "allow.everyone.if.no.acl.found": "false",
    }


def client_settings(settings: Settings, principal: str, password: str | None = None) -> Settings:
    """``settings`` as ``principal`` on the secured stack (password from credentials.yaml unless given)."""
    if password is None:
        users = load_credentials(settings).get("kafka", {})
        if principal not in users:
            raise KeyError(f"no credentials for principal {principal!r} in {security_files(settings).credentials}")
        password = users[principal]
    return settings.model_copy(update={
        "kafka_username": principal, "kafka_password": SecretStr(password),
        "kafka_ca_file": str(security_files(settings).ca),
    })


def s3_settings(settings: Settings, role: str) -> Settings:
    """``settings`` with the S3 identity (and, for readers, the read-only endpoint) of ``role``."""
    key, secret = load_credentials(settings)["s3"][role]
    update: dict[str, Any] = {"s3_access_key": key, "s3_secret_key": secret}
    if role == "reader":
        update.update(s3_endpoint=f"http://127.0.0.1:{settings.s3_read_port}")
    return settings.model_copy(update=update)


def faust_credentials(settings: Settings):
    """Faust's ``broker_credentials`` for settings' SASL/TLS client settings, or None when plaintext."""
    import ssl

    import faust

    ctx = ssl.create_default_context(cafile=settings.kafka_ca_file) if settings.kafka_ca_file else None
    if settings.kafka_username:
        return faust.SASLCredentials(username=settings.kafka_username,
                                     password=settings.kafka_password.get_secret_value(),
                                     ssl_context=ctx, mechanism=settings.kafka_sasl_mechanism)
    return faust.SSLCredentials(ctx) if ctx else None


def broker_overrides(settings: Settings) -> dict[str, str]:
    """Secure server.properties entries for the local broker, creating TLS material and users on first use."""
    from .acls import principals

    files = security_files(settings)
    ensure_tls(files)
    creds = ensure_credentials(files, principals())
    return secure_broker_properties(settings, files, creds["kafka"][ADMIN])


def format_args(settings: Settings) -> list[str]:
    """SCRAM users (admin and every principal of acls.yaml) for ``kafka-storage format``."""
    from .acls import principals

    return scram_format_args(ensure_credentials(security_files(settings), principals())["kafka"])


def admin_view(settings: Settings) -> Settings:
    """The secured stack's own settings: Kafka as ``admin``, S3 as the checkpoint writer."""
    from .acls import principals

    files = security_files(settings)
    ensure_tls(files)
    creds = ensure_credentials(files, principals())
    key, secret = creds["s3"]["writer"]
    return client_settings(settings, ADMIN, creds["kafka"][ADMIN]).model_copy(
        update={"s3_access_key": key, "s3_secret_key": secret})


# ------------------------------------------------------------------------------------- errors

# librdkafka error names that mean "the broker knows who you are and refuses" or "you are not who you say".
AUTHZ_ERRORS = {"TOPIC_AUTHORIZATION_FAILED", "GROUP_AUTHORIZATION_FAILED", "CLUSTER_AUTHORIZATION_FAILED",
                "TRANSACTIONAL_ID_AUTHORIZATION_FAILED"}
AUTHN_ERRORS = {"_AUTHENTICATION", "SASL_AUTHENTICATION_FAILED", "_SSL"}


class AccessDenied(PermissionError):
    """The cluster refused this principal an operation (ACLs) or refused its credentials."""


def access_denied(settings: Settings, error_name: str, detail: str, what: str) -> AccessDenied:
    """One-line AccessDenied naming the principal, the operation and where the grants live."""
    who = settings.kafka_username or "ANONYMOUS"
    if error_name == "_SSL":
        return AccessDenied(f"TLS with kafka at {settings.kafka_bootstrap} failed ({detail}); check kafka_ca_file")
    if error_name in AUTHN_ERRORS:
        return AccessDenied(f"kafka at {settings.kafka_bootstrap} refused the credentials of {who!r} ({detail})")
    return AccessDenied(f"kafka: principal {who!r} may not {what} ({error_name}: {detail}); "
                        "grants are in infra/acls.yaml (`polarstream infra acls --print`)")


def mirror_client_properties(alias: str, settings: Settings) -> dict[str, str]:
    """MirrorMaker 2 per-cluster client settings (``<alias>.security.protocol`` ...) from ``settings``.

    The password lands in the MM2 properties file (MirrorMaker writes it with mode 0600); keeping it
    out of the file would need a Kafka config provider, which the local setup does not configure.
    """
    out: dict[str, str] = {}
    if settings.kafka_ca_file:
        out.update({f"{alias}.ssl.truststore.type": "PEM", f"{alias}.ssl.truststore.location": settings.kafka_ca_file})
    if settings.kafka_username:
        module = ("org.apache.kafka.common.security.scram.ScramLoginModule" if settings.kafka_sasl_mechanism.startswith("SCRAM")
                  else "org.apache.kafka.common.security.plain.PlainLoginModule")
        password = settings.kafka_password.get_secret_value().replace("\\", "\\\\").replace('"', '\\"')
        out.update({
            f"{alias}.security.protocol": "SASL_SSL" if settings.kafka_ca_file else "SASL_PLAINTEXT",
            f"{alias}.sasl.mechanism": settings.kafka_sasl_mechanism,
            f"{alias}.sasl.jaas.config": f'{module} required username="{settings.kafka_username}" password="{password}";',
        })
    elif settings.kafka_ca_file:
        out[f"{alias}.security.protocol"] = "SSL"
    return out
