"""One server of the stack in the foreground, on a host (or container) of its own: ``polarstream infra serve``.

    polarstream infra serve kafka --node-id 2 --voters 1@kafka-1:9093,2@kafka-2:9093,3@kafka-3:9093 \\
        --cluster-id ID --advertise kafka-2
    polarstream infra serve s3

``infra up`` starts the whole stack detached on one machine; a run across hosts (containers, Slurm, pods)
wants each server as the main process of its own host, serving on every interface under the name the
others reach it by, and gone when that process is. So this starts it (the same KafkaBroker and S3Server
as ``infra up``), prints one ready line, and waits: it exits when the server does (with its log's tail) and
stops the server on SIGTERM. The quorum's voters and cluster id are given, not discovered: every node of
one cluster is started with the same ones.
"""

from __future__ import annotations

import signal
import time

from .errors import InfraError
from .kafka import ClusterMember, KafkaBroker
from .process import JavaServer
from .s3 import S3Server
from .settings import Settings


def kafka_node(settings: Settings, node_id: int, voters: str, cluster_id: str, advertise: str,
               heap_mb: int = 512) -> KafkaBroker:
    """Node ``node_id`` of the cluster whose controllers are ``voters`` (``id@host:port,...``)."""
    brokers = len([v for v in voters.split(",") if v.strip()])
    if not 1 <= node_id <= brokers:
        raise InfraError(f"--node-id {node_id}: the voters name nodes 1 to {brokers}")
    member = ClusterMember(node_id=node_id, brokers=brokers, voters=voters, cluster_id=cluster_id)
    return KafkaBroker(settings, heap_mb=heap_mb, member=member, advertise=advertise, die_with_parent=True)


def s3_server(settings: Settings) -> S3Server:
    return S3Server(settings, public=True, die_with_parent=True)


def serve(server: JavaServer, timeout_s: float = 180.0) -> int:
    """Start ``server``, say when it is ready, and wait for it: 0 when stopped by SIGTERM, 1 when it died."""
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    server.start(timeout_s)
    print(f"{server.label()} ready (advertised to others as configured)", flush=True)
    while not stopping:
        if server.pid() is None:
            print(f"{server.label()} exited; log {server.log_file}:\n{server.log_tail()}", flush=True)
            return 1
        time.sleep(1.0)
    server.stop()
    return 0
