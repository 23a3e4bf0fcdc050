"""Named local Kafka clusters that run side by side: one per datacenter of a multi-DC setup.

``polarstream infra up --cluster eu`` starts a broker whose data lives under
``<data_dir>/clusters/eu`` and whose ports were chosen free on first use and remembered in that
directory's ``cluster.json``, so every later command (and every process given ``home_cluster: eu``)
finds the same cluster again. A named cluster is Kafka only: object storage (checkpoints) is central
and stays with the default stack.

``up --cluster eu --secure`` makes it a secured cluster (SASL_SSL + ACLs, docs/security.md) with its
own CA and users under ``<data_dir>/clusters/eu/security/``, as a separate datacenter would have;
``cluster.json`` remembers ``secure`` so status, topics, acls, down and mirror need no flag.

Reading that state (names, ``cluster.json``, a home cluster's bootstrap) is infra/discovery.py's, which
``Settings`` uses; this module creates, starts and stops the clusters.
"""

from __future__ import annotations

import json

from .discovery import CLUSTER_STATE, check_name, cluster_dir, clusters_root, read_cluster_state
from .errors import InfraError
from .process import free_port
from .settings import Settings


def _write_state(base: Settings, name: str, state: dict) -> None:
    directory = cluster_dir(base.data_dir, name)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{CLUSTER_STATE}.tmp"
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(directory / CLUSTER_STATE)  # atomic: a concurrent reader sees no file or a whole one


def formatted(base: Settings, name: str) -> bool:
    """True once the cluster's broker formatted its storage (its security mode is then fixed)."""
    return (cluster_dir(base.data_dir, name) / "kafka" / "data" / "meta.properties").exists()


def cluster_settings(base: Settings, name: str, create: bool = False, secure: bool = False) -> Settings:
    """Settings for cluster ``name``: its data_dir, ports, bootstrap and ``secure``; the rest from ``base``.

    With ``create`` a cluster seen for the first time gets free ports, written to its state file;
    without it an unknown cluster is an InfraError that says how to create it. ``secure`` (with
    ``create``) marks a new or never-started cluster as secured; a cluster that already holds
    plaintext data cannot be turned secure (its storage has no SCRAM users).
    """
    state = read_cluster_state(base.data_dir, name)
    if state is None:
        if not create:
            raise InfraError(f"cluster {name!r} is unknown under {clusters_root(base.data_dir)}: "
                             f"run `polarstream infra up --cluster {name}` first")
        state = {"name": name, "kafka_port": free_port(), "kafka_controller_port": free_port(), "secure": secure}
        _write_state(base, name, state)
    elif create and secure and not state.get("secure"):
        if formatted(base, name):
            raise InfraError(f"cluster {name!r} holds plaintext data ({cluster_dir(base.data_dir, name)}): it cannot "
                             f"become secured; `polarstream infra down --cluster {name}`, delete that directory, then "
                             f"`up --cluster {name} --secure`")
        state = {**state, "secure": True}
        _write_state(base, name, state)
    port = int(state["kafka_port"])
    is_secure = bool(state.get("secure"))
    return base.model_copy(update={
        "data_dir": cluster_dir(base.data_dir, name), "kafka_port": port,
        "kafka_controller_port": int(state["kafka_controller_port"]), "kafka_bootstrap": f"127.0.0.1:{port}",
        "home_cluster": "", "secure": is_secure,
        # A secured cluster's clients trust its own CA; a plaintext one gets no TLS or SASL settings.
        "kafka_ca_file": str(cluster_dir(base.data_dir, name) / "security" / "ca.pem") if is_secure else "",
        **({} if is_secure else {"kafka_username": "", "kafka_security": {}}),
    })


def cluster_admin(base: Settings, name: str) -> Settings:
    """Cluster ``name``'s settings as a client with full rights: its admin when secured, else plaintext."""
    from .security import admin_view

    settings = cluster_settings(base, name)
    return admin_view(settings) if settings.secure else settings


def forget_ports(base: Settings, name: str) -> None:
    """Drop the remembered ports (after they turned out to be taken), so the next up chooses again."""
    (cluster_dir(base.data_dir, name) / CLUSTER_STATE).unlink(missing_ok=True)


class Cluster:
    """A named cluster's broker and topics: `infra up|down|status|topics --cluster NAME`."""

    def __init__(self, base: Settings, name: str, create: bool = False, ephemeral: bool = False, heap_mb: int = 512,
                 secure: bool = False):
        self.base, self.name, self.ephemeral, self.heap_mb = base, check_name(name), ephemeral, heap_mb
        self._bind(create, secure)

    def _bind(self, create: bool, secure: bool = False) -> None:
        from .kafka import KafkaBroker
        from .security import admin_view

        self.settings = cluster_settings(self.base, self.name, create=create, secure=secure)
        if self.settings.secure:  # the cluster acts as its own admin (creates CA and users on first use)
            self.settings = admin_view(self.settings)
        # ephemeral (tests, benchmarks): tied to this process, C1-only JIT for a faster start.
        self.kafka = KafkaBroker(self.settings, heap_mb=self.heap_mb, die_with_parent=self.ephemeral,
                                 quick_jit=self.ephemeral)

    def up(self, timeout: float = 90.0):
        """Start the broker unless it runs, then apply topics.yaml; returns the TopicReport."""
        from .maven import fetch
        from .topics import ensure_topics

        fetch("kafka", self.settings)
        try:
            self.kafka.start(timeout)
        except InfraError as e:
            # Ports remembered from a first `up` that never got to format its storage may be taken
            # by now: choose fresh ones once. A cluster with data keeps its ports (clients know them).
            if "already in use" not in str(e) or (self.kafka.log_dir / "meta.properties").exists():
                raise
            forget_ports(self.base, self.name)
            self._bind(create=True, secure=self.settings.secure)
            self.kafka.start(timeout)
        report = ensure_topics(self.settings)
        if self.settings.secure:
            from .acls import apply_acls

            apply_acls(self.settings)
        return report

    def down(self) -> dict[str, bool]:
        """Stop the broker; says whether it was running."""
        return {"kafka": self.kafka.stop()}

    def status(self) -> dict:
        """The broker's status plus the cluster's name, topic prefix and data directory."""
        return {"cluster": self.name, "kafka": {**self.kafka.status(), "secure": self.settings.secure},
                "topic_prefix": self.settings.topic_prefix, "data_dir": str(self.settings.data_dir),
                "secure": self.settings.secure}
