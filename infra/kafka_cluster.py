"""A replicated local Kafka cluster: ``polarstream infra up --brokers 3``.

Three (or N) combined broker+controller nodes on 127.0.0.1, one static KRaft quorum of all of them, one
cluster id. Node ``i`` (1-based) lives under ``<data_dir>/kafka/broker-<i>`` (config, log, pid file,
``data/``). The first node listens on the settings' ``kafka_port``/``kafka_controller_port``; node ``i``
takes those plus ``2 * (i - 1)`` (9094/9095, 9096/9097 by default), or free ports when those are taken.

The layout is chosen once and remembered in ``<data_dir>/kafka/brokers.json`` (node ids, ports, cluster
id), so ``infra down``/``status`` and every component started with that data_dir find all the brokers:
``Settings.kafka_bootstrap`` defaults to the list of every node (``local_bootstrap``, infra/discovery.py).

Topics get replication factor min(3, brokers) and, from 3 brokers on, ``min.insync.replicas=2``
(infra/topics.py); the brokers' own defaults say the same for internal topics (consumer offsets,
transaction state), so offsets and transactions survive the loss of one broker.

``kill(i)`` SIGKILLs one node as a crash would and ``revive(i)`` starts it again on its data (chaos runs).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from .discovery import BROKERS_STATE, brokers_state_file, read_brokers_state
from .errors import InfraError
from .kafka import ClusterMember, KafkaBroker, cluster_id
from .process import free_port, port_in_use, tcp_open
from .settings import Settings

MAX_BROKERS = 9


def _layout(settings: Settings, brokers: int) -> dict:
    """Node ids and ports for a new cluster: the settings' ports, then +2 per node, else free ones."""
    used: set[int] = set()
    nodes = []
    for i in range(brokers):
        ports = []
        for base in (settings.kafka_port, settings.kafka_controller_port):
            port = base + 2 * i
            if i and (port in used or port > 65535 or port_in_use(port)):
                port = free_port()
                while port in used:
                    port = free_port()
            used.add(port)
            ports.append(port)
        nodes.append({"node_id": i + 1, "port": ports[0], "controller_port": ports[1]})
    return {"brokers": brokers, "cluster_id": cluster_id(), "nodes": nodes}


def resolve_brokers(settings: Settings, brokers: int | None) -> int:
    """How many brokers the stack under ``settings.data_dir`` has: ``brokers`` if given and consistent
    with what is on disk, else what is remembered (1 when nothing is)."""
    state = read_brokers_state(settings.data_dir)
    if brokers is not None and not 1 <= brokers <= MAX_BROKERS:
        raise InfraError(f"--brokers {brokers}: expected 1 to {MAX_BROKERS}")
    if state is not None:
        if brokers is not None and brokers != state["brokers"]:
            raise InfraError(f"{settings.data_dir} holds a {state['brokers']}-broker cluster, not {brokers}: use "
                             f"--brokers {state['brokers']} (or no --brokers), or another data_dir")
        return int(state["brokers"])
    if brokers and brokers > 1:
        if (settings.data_dir / "kafka" / "data" / "meta.properties").exists():
            raise InfraError(f"{settings.data_dir} holds a single-broker Kafka: `polarstream infra down`, then use "
                             f"another data_dir (POLAR_DATA_DIR) for a {brokers}-broker cluster, or delete "
                             f"{settings.data_dir / 'kafka'}")
        if settings.secure:
            raise InfraError("--secure with --brokers > 1 is not supported yet: the secured stack is one broker")
    return brokers or 1


class KafkaCluster:
    """N local brokers as one thing to launch, wait for, stop and ask about (``Stack.kafka`` when N > 1).

    ``brokers`` is needed only the first time (it is then remembered). ``die_with_parent`` and
    ``quick_jit`` are KafkaBroker's (tests, benchmarks): a node started from the main thread dies with
    this process, and C1-only JIT starts three JVMs on two cores in about 10 s.
    """

    def __init__(self, settings: Settings, brokers: int | None = None, heap_mb: int = 512,
                 die_with_parent: bool = False, quick_jit: bool = False):
        self.base = settings
        state = read_brokers_state(settings.data_dir)
        if state is None:
            if not brokers or brokers < 2:
                raise InfraError(f"no replicated cluster under {settings.data_dir}: give brokers >= 2 to create one")
            state = _layout(settings, resolve_brokers(settings, brokers))
            self._fresh = True
        else:
            resolve_brokers(settings, brokers)
            self._fresh = False
        self.state = state
        self.brokers: int = int(state["brokers"])
        voters = ",".join(f"{n['node_id']}@127.0.0.1:{n['controller_port']}" for n in state["nodes"])
        self.nodes: list[KafkaBroker] = []
        for n in state["nodes"]:
            member = ClusterMember(int(n["node_id"]), self.brokers, voters, state["cluster_id"])
            node_settings = settings.model_copy(update={
                "kafka_port": int(n["port"]), "kafka_controller_port": int(n["controller_port"]),
                "kafka_bootstrap": f"127.0.0.1:{n['port']}"})
            self.nodes.append(KafkaBroker(node_settings, heap_mb=heap_mb, member=member,
                                          die_with_parent=die_with_parent, quick_jit=quick_jit))

    # -- what Stack and clients need --
    @property
    def bootstrap(self) -> str:
        """Every node, comma separated: a client finds the cluster through any one that is up."""
        return ",".join(node.bootstrap for node in self.nodes)

    @property
    def root(self) -> Path:
        return self.base.data_dir / "kafka"

    def _save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{BROKERS_STATE}.tmp"
        tmp.write_text(json.dumps(self.state, indent=2))
        tmp.replace(brokers_state_file(self.base.data_dir))  # atomic: readers see no file or a whole one
        self._fresh = False

    def pid(self) -> int | None:
        """Pid of the first running node (None when none runs)."""
        return next((p for p in (node.pid() for node in self.nodes) if p is not None), None)

    def launch(self) -> bool:
        """Spawn every node that is not running, without waiting; True when any was started.

        All must boot side by side: a node becomes ready only once a majority of the quorum runs."""
        fresh = self._fresh
        if fresh:
            self._save()
        started = False
        try:
            for node in self.nodes:
                started = node.launch() or started
        except BaseException:
            self.stop(force=True)
            if fresh and not any((node.log_dir / "meta.properties").exists() for node in self.nodes):
                # Nothing was formatted: forget the ports, so the next try may choose others.
                brokers_state_file(self.base.data_dir).unlink(missing_ok=True)
                self._fresh = True
            raise
        return started

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Block until every node serves metadata (one deadline for all)."""
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            node.wait_ready(max(1.0, deadline - time.monotonic()))

    def start(self, timeout: float = 90.0) -> bool:
        started = self.launch()
        self.wait_ready(timeout)
        return started

    def stop(self, timeout: float = 30.0, force: bool = False) -> bool:
        """Stop every node (SIGTERM, SIGKILL after ``timeout``; at once with ``force``); True when any ran.

        SIGTERM goes to all nodes first, so no node waits on a controlled shutdown of a quorum that the
        others have already left."""
        running = [(node, node.pid()) for node in self.nodes]
        running = [(node, pid) for node, pid in running if pid is not None]
        if not force:
            for node, pid in running:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for node, _ in running:
            node.stop(timeout, force=force)
        return bool(running)

    def status(self) -> dict:
        """Like ``KafkaBroker.status`` for the whole cluster, with one entry per node."""
        nodes = [{**node.status(), "node_id": node.member.node_id} for node in self.nodes]
        return {
            "up": all(n["up"] for n in nodes), "brokers": self.brokers, "brokers_up": sum(n["up"] for n in nodes),
            "pid": self.pid(), "bootstrap": self.bootstrap, "port": nodes[0]["port"],
            "controller_port": nodes[0]["controller_port"], "data_dir": str(self.root), "log": nodes[0]["log"],
            "replication_factor": min(3, self.brokers), "min_insync_replicas": 2 if self.brokers >= 3 else 1,
            "nodes": nodes,
        }

    # -- chaos --
    def kill(self, index: int) -> int:
        """SIGKILL node ``index`` (0-based), as a crash would, and wait until it is gone; returns its pid.
        Its data stays as the crash left it; ``revive`` starts it again."""
        node = self.nodes[index]
        pid = node.pid()
        if pid is None:
            raise InfraError(f"{node.label()} is not running")
        node.stop(force=True)
        return pid

    def revive(self, index: int, timeout: float = 90.0) -> None:
        """Start node ``index`` again on its data and wait until it serves (the others keep serving).

        Call it from the main thread when the node must die with this process (``die_with_parent``):
        or ``nodes[index].launch()`` there, and ``nodes[index].wait_ready()`` anywhere."""
        self.nodes[index].start(timeout)

    def kill_and_restart(self, index: int, down_s: float = 0.0, timeout: float = 90.0) -> float:
        """SIGKILL node ``index``, leave it down ``down_s`` seconds, start it again; returns the seconds
        from the kill until it served again."""
        start = time.monotonic()
        self.kill(index)
        time.sleep(down_s)
        self.revive(index, timeout)
        return time.monotonic() - start

    def index_of(self, node_id: int) -> int:
        """The index (0-based) of the node with Kafka node id ``node_id``."""
        for i, node in enumerate(self.nodes):
            if node.member.node_id == node_id:
                return i
        raise InfraError(f"no node {node_id} in this cluster ({self.brokers} brokers)")

    def leader_index(self, topic: str, partition: int = 0, timeout: float = 10.0) -> int:
        """The index of the node that leads ``topic``/``partition`` now."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient(self.base.kafka_config(**{"bootstrap.servers": self.bootstrap, "log_level": 0}))
        deadline = time.monotonic() + timeout
        while True:  # a node that has not applied the latest metadata yet answers without the partition
            meta = admin.list_topics(topic, timeout=timeout).topics.get(topic)
            part = meta.partitions.get(partition) if meta is not None else None
            if part is not None and part.leader >= 0:
                return self.index_of(part.leader)
            if time.monotonic() > deadline:
                raise InfraError(f"{topic}[{partition}] has no leader now")
            time.sleep(0.1)

    def running(self) -> list[bool]:
        """Per node: is its process alive and its port open."""
        return [node.pid() is not None and tcp_open(node.settings.kafka_port) for node in self.nodes]
