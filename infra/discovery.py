"""Which local Kafka clusters a data directory holds, read from the state files they leave there.

A replicated cluster (``infra up --brokers 3``, infra/kafka_cluster.py) remembers its nodes in
``<data_dir>/kafka/brokers.json``; a named cluster (``infra up --cluster eu``, infra/clusters.py) its
ports and whether it is secured in ``<data_dir>/clusters/<name>/cluster.json``. ``Settings`` reads them
to resolve its bootstrap, so this module is a leaf: it takes a data directory, not ``Settings``, and
imports nothing of infra/ but its errors. The modules that create the clusters write the files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .errors import InfraError

BROKERS_STATE = "brokers.json"
CLUSTER_STATE = "cluster.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,39}$")


# --------------------------------------------------------------------------- a replicated cluster


def brokers_state_file(data_dir: Path) -> Path:
    """Where a replicated local cluster under ``data_dir`` remembers its layout."""
    return Path(data_dir) / "kafka" / BROKERS_STATE


def read_brokers_state(data_dir: Path) -> dict | None:
    """The remembered layout (``brokers``, ``cluster_id``, ``nodes``), or None for a single broker."""
    try:
        return json.loads(brokers_state_file(data_dir).read_text())
    except (OSError, ValueError):
        return None


def local_bootstrap(data_dir: Path) -> str | None:
    """``127.0.0.1:p1,127.0.0.1:p2,...`` for the replicated cluster under ``data_dir``, else None."""
    state = read_brokers_state(data_dir)
    if not state:
        return None
    return ",".join(f"127.0.0.1:{int(n['port'])}" for n in state["nodes"])


# --------------------------------------------------------------------------- named clusters


def check_name(name: str) -> str:
    """``name`` when it can be a cluster name (also an MM2 cluster alias, so no dots or spaces)."""
    if not _NAME.match(name or ""):
        raise InfraError(f"bad cluster name {name!r}: use letters, digits, '-' or '_' (at most 40), starting "
                         "with a letter or digit")
    return name


def clusters_root(data_dir: Path) -> Path:
    """Where named clusters keep their state and data."""
    return data_dir / "clusters"


def cluster_dir(data_dir: Path, name: str) -> Path:
    """The data directory of cluster ``name``."""
    return clusters_root(data_dir) / check_name(name)


def read_cluster_state(data_dir: Path, name: str) -> dict | None:
    """The remembered ports of cluster ``name``, or None when it was never brought up."""
    try:
        return json.loads((cluster_dir(data_dir, name) / CLUSTER_STATE).read_text())
    except (OSError, ValueError):
        return None


def cluster_names(data_dir: Path) -> list[str]:
    """Every cluster that has a state file, sorted."""
    root = clusters_root(data_dir)
    return sorted(p.parent.name for p in root.glob(f"*/{CLUSTER_STATE}")) if root.exists() else []


def home_bootstrap(home: str, data_dir: Path) -> str:
    """The bootstrap of home cluster ``home``: a named local cluster, or ``host:port[,...]`` as given."""
    if ":" in home:
        return home
    state = read_cluster_state(data_dir, home)
    if state is None:
        raise InfraError(f"home_cluster {home!r}: no such local cluster under {clusters_root(data_dir)}; "
                         f"run `polarstream infra up --cluster {home}` or give host:port")
    return f"127.0.0.1:{int(state['kafka_port'])}"


def home_ca_file(home: str, data_dir: Path) -> str:
    """The CA a client of home cluster ``home`` must trust: a secured local cluster's own, else ''."""
    state = None if ":" in home else read_cluster_state(data_dir, home)
    return str(cluster_dir(data_dir, home) / "security" / "ca.pem") if state and state.get("secure") else ""
