"""One typed settings object for every component.

Values come from (highest first): explicit keyword arguments, ``POLAR_*`` environment variables,
an optional YAML file (``POLAR_CONFIG`` or ``--config``), then the defaults below. Unknown keys are an
error, so a typo in a config file fails loudly instead of silently using a default.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from .discovery import home_bootstrap, home_ca_file, local_bootstrap
from .errors import InfraError

CACHE_DIR = Path(os.environ.get("POLAR_CACHE_DIR", Path.home() / ".cache" / "polarstream"))

# Logical topic names from the blueprint; a prefix lets several runs share one cluster.
TOPICS = ("tasks", "sessions", "calls", "session-events", "trajectories", "groups", "policy")


class _YamlSource(PydanticBaseSettingsSource):
    def __init__(self, settings_cls: type[BaseSettings], path: str | None):
        super().__init__(settings_cls)
        self.path = path

    def get_field_value(self, field, field_name):  # pragma: no cover - unused by __call__
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        if not self.path:
            return {}
        try:
            f = Path(self.path).open()
        except FileNotFoundError:  # say which file it was: the settings (--config or POLAR_CONFIG)
            raise FileNotFoundError(errno.ENOENT, "no such settings file", self.path) from None
        with f:  # a stream, so a YAML error names the file
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise InfraError(f"{self.path}: expected a mapping of settings at the top level")
        return data


# Development credentials: public defaults, refused off loopback (gateway/exposure.py, the viewer).
DEV_ADMIN_TOKEN = "polar-admin"
DEV_SESSION_SECRET = "polar-dev-session-secret"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="POLAR_", extra="forbid", validate_default=True)

    # Kafka
    kafka_bootstrap: str = Field("127.0.0.1:9092", description="bootstrap servers, comma separated")
    kafka_port: int = 9092
    kafka_controller_port: int = 9093
    topic_prefix: str = Field("", description="prepended to every topic name, e.g. 'exp1.'")
    # Multi-DC (docs/multi-dc.md): the cluster this process publishes to and reads from, a named local
    # cluster (`infra up --cluster NAME`) or host:port; it only decides kafka_bootstrap.
    home_cluster: str = Field("", description="named local cluster or host:port; sets kafka_bootstrap")
    kafka_security: dict[str, str] = Field(default_factory=dict, description="extra librdkafka client settings (SASL/TLS)")
    # A secured cluster (docs/security.md): a username turns SASL on, a CA file turns TLS on.
    kafka_username: str = Field("", description="SASL principal of this component ('' = no SASL)")
    kafka_password: SecretStr = Field(SecretStr(""), description="SASL password (never logged or recorded)")
    kafka_sasl_mechanism: str = "SCRAM-SHA-512"
    kafka_ca_file: str = Field("", description="PEM CA bundle that signed the brokers' certificates ('' = no TLS)")
    secure: bool = Field(False, description="`infra up` runs the local stack secured: SASL_SSL, ACLs, read-only S3")
    # How records are written (docs/events.md): token arrays as raw little-endian bytes, or all JSON as
    # before. Readers take both, so a cluster can switch at any time.
    record_format: Literal["packed", "json"] = Field("packed", description="packed (binary token arrays) or json")

    # Object storage
    storage_url: str = Field("", description="checkpoint root; '' means file://<data_dir>/checkpoints")
    s3_port: int = 9000
    s3_endpoint: str = ""  # '' means http://127.0.0.1:<s3_port>
    s3_bucket: str = "polarstream"
    s3_access_key: str = "polaradmin"
    s3_secret_key: str = Field("polaradmin-secret", repr=False)  # repr=False: never in a logged Settings
    s3_read_port: int = 9001  # secure stack: a read-only S3 server (own identity) for checkpoint readers
    s3_region: str = "eu-west-1"  # not us-east-1: s3fs sends a LocationConstraint that some servers reject

    # Local state
    data_dir: Path = Field(default_factory=lambda: Path(os.environ.get("POLAR_DATA_DIR", ".polar")).absolute())
    cache_dir: Path = CACHE_DIR

    # Past one machine (docs/deploy.md): the one address the others reach this machine's components at
    advertised_host: str = Field("", description="the name or address other machines reach this one's components "
                                 "at: every URL a component started here announces (engine, gateway node, rollout "
                                 "server, metrics, the trainer's weight-transfer rendezvous) uses it, and they "
                                 "listen on every interface; '' = 127.0.0.1, a run on one machine")

    # Service ports
    engine_port: int = 8000
    gateway_port: int = 8100
    rollout_port: int = 8080
    admin_token: str = Field(DEV_ADMIN_TOKEN, repr=False)
    session_secret: str = Field(DEV_SESSION_SECRET, repr=False)
    session_key_ttl_s: float = Field(7 * 24 * 3600, gt=0, description="how long a minted session key is valid")

    # A deployment starts its parts in any order (infra/reach.py)
    wait_for_s: float = Field(60.0, ge=0, description="how long a long-running component (node, gateway, trainer, "
                              "stream worker, rollout server, viewer) waits for the Kafka, S3 and engines it needs, "
                              "saying what it waits for, before it gives up; 0: at once")

    config: str | None = Field(None, description="optional YAML file with any of these settings")

    @model_validator(mode="after")
    def _bootstrap_follows_port(self) -> "Settings":
        # POLAR_KAFKA_PORT alone moves both the broker and its clients; an explicit bootstrap wins.
        if "kafka_bootstrap" not in self.model_fields_set:
            self.kafka_bootstrap = f"127.0.0.1:{self.kafka_port}"
            # `infra up --brokers 3` remembered its nodes under data_dir: clients get all of them.
            self.kafka_bootstrap = local_bootstrap(self.data_dir) or self.kafka_bootstrap
            if self.home_cluster:
                self.kafka_bootstrap = home_bootstrap(self.home_cluster, self.data_dir)
                # A secured local home cluster has its own CA: its clients trust it without being told.
                self.kafka_ca_file = self.kafka_ca_file or home_ca_file(self.home_cluster, self.data_dir)
        return self

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        path = init_settings.init_kwargs.get("config") or os.environ.get("POLAR_CONFIG")
        return (init_settings, env_settings, _YamlSource(settings_cls, path))

    # -- derived values (derived, not stored, so they can never disagree) --
    def topic(self, name: str) -> str:
        """Full topic name for a logical name such as ``calls`` or ``polar.calls``."""
        name = name.removeprefix("polar.")
        if name not in TOPICS:
            raise ValueError(f"unknown topic {name!r}; expected one of {', '.join(TOPICS)}")
        return f"{self.topic_prefix}polar.{name}"

    @property
    def announced_host(self) -> str:
        """The host in every URL a component here announces (advertised_host; one machine: loopback)."""
        return self.advertised_host or "127.0.0.1"

    @property
    def listen_host(self) -> str:
        """Where a component here listens: loopback on one machine, every interface once others must reach it
        (the advertised name may be a service's or a NAT's, not an address of this machine to bind)."""
        return "127.0.0.1" if self.announced_host in ("127.0.0.1", "localhost", "::1") else "0.0.0.0"

    @property
    def s3_endpoint_url(self) -> str:
        return self.s3_endpoint or f"http://127.0.0.1:{self.s3_port}"

    @property
    def packed(self) -> bool:
        """Records are written packed (binary token arrays), else JSON: the one place that decides."""
        return self.record_format == "packed"

    @property
    def checkpoint_url(self) -> str:
        return self.storage_url or f"file://{self.data_dir / 'checkpoints'}"

    def kafka_config(self, **extra: Any) -> dict[str, Any]:
        """librdkafka client configuration shared by producers and consumers."""
        return {"bootstrap.servers": self.kafka_bootstrap, **self.kafka_auth(), **self.kafka_security, **extra}

    def kafka_auth(self) -> dict[str, str]:
        """librdkafka security settings derived from kafka_username / kafka_ca_file ({} for plaintext)."""
        tls = bool(self.kafka_ca_file)
        out = {"ssl.ca.location": self.kafka_ca_file} if tls else {}
        if self.kafka_username:
            return {**out, "security.protocol": "SASL_SSL" if tls else "SASL_PLAINTEXT",
                    "sasl.mechanism": self.kafka_sasl_mechanism, "sasl.username": self.kafka_username,
                    "sasl.password": self.kafka_password.get_secret_value()}
        return {**out, "security.protocol": "SSL"} if tls else out

    def storage_options(self, url: str) -> dict[str, Any]:
        """fsspec options for a URL: s3:// goes to our S3 server with our credentials."""
        if url.startswith("s3://"):
            return {
                "key": self.s3_access_key,
                "secret": self.s3_secret_key,
                "client_kwargs": {"endpoint_url": self.s3_endpoint_url, "region_name": self.s3_region},
            }
        return {}
