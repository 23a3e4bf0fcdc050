"""A gateway node's own configuration (what ``polarstream node`` flags set).

Cluster-wide values (Kafka, topic prefix, session secret) come from ``infra.settings``; the gateway's
engine settings from ``gateway.config.GatewayConfig``. Defaults follow Polar's node defaults
(``max_init_workers`` 4, ``max_run_workers`` 2, ``max_postrun_workers`` 4).
"""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from gateway.runtimes.site import site_mode


@dataclass
class NodeConfig:
    work_dir: Path  # sessions' workspaces, homes and logs live under <work_dir>/sessions
    cache_dir: Path  # where `polarstream harness install` put the npm CLIs
    node_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
    runtime: str = "bwrap"  # gateway.runtimes.RUNTIMES: auto | subprocess | bwrap | podman | docker | apptainer
    image: str = ""  # podman / docker / apptainer image for tasks that bring none
    # The host's CA bundle, proxies and package index into image builds and session containers
    # (gateway/runtimes/site.py): "auto" where the host has them, "off"; "" = POLAR_SITE_SETTINGS, else auto.
    site_settings: str = ""
    init_workers: int = 4  # concurrent INIT stages (workspace + prepare)
    ready_target: int = 2  # prepared sessions kept waiting for a run slot (0: prepare only when a slot frees)
    run_workers: int = 2  # concurrent harness runs (what keeps the engine busy)
    postrun_workers: int = 4  # concurrent evaluations
    # Containers of an image task: started ahead of need, up to capacity per shape (gateway/runtimes/
    # prepared.py: a step's burst of sessions finds them ready); at most container_starts starting at once,
    # and container_start_rate a second
    container_starts: int = 4
    container_start_rate: float = 8.0
    model_name: str = "polar"  # model name harnesses ask for (the gateway serves its model under any name)
    cpu_s: int | None = None  # RLIMIT_CPU per harness process
    memory_mb: int | None = None  # RLIMIT_AS per harness process (Node CLIs need several GB of address space)
    prepare_attempts: int = 3
    settle_timeout_s: float = 30.0  # after a run, how long to wait for its in-flight call to be recorded
    keep_workdirs: bool = False  # keep session directories for debugging
    consumer_group: str = "polar-nodes"  # all nodes of one cluster share it: more nodes, more capacity
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 0  # 0: a free port

    def __post_init__(self) -> None:
        for name in ("init_workers", "run_workers", "postrun_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1")
        if self.container_starts < 1 or self.container_start_rate <= 0:
            raise ValueError("container_starts: must be at least 1; container_start_rate: must be above 0")
        if self.ready_target < 0:
            raise ValueError("ready_target: must be >= 0")
        site_mode(self.site_settings)  # ValueError names it

    @property
    def capacity(self) -> int:
        """Sessions a node takes from polar.sessions before RUN ends: running + READY buffer."""
        return self.run_workers + self.ready_target
