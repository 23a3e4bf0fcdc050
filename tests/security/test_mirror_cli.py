"""Secure multi-DC from the command line, as a user runs it (docs/multi-dc.md, docs/security.md).

Two secured named clusters (each its own CA and users), `infra mirror` between them with TLS + SASL
on both links and no literal password in the properties file, a call published in the region by its
`gateway` principal reaching the center, `infra status --json` showing the flow at lag 0, then
everything stopped through the CLI with no Java process left.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from infra.clusters import Cluster, cluster_admin
from infra.discovery import read_cluster_state
from infra.mirror import MirrorMaker, parse_properties
from infra.process import pid_alive
from infra.settings import Settings
from producers.consumer import RecordConsumer
from producers.publisher import Publisher
from schemas import CallRecorded

pytestmark = pytest.mark.integration
PREFIX = "sm."


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "from polarstream.cli import main; main()", "infra", *args]


def _env(tmp_path) -> dict:
    return {**os.environ, "POLAR_DATA_DIR": str(tmp_path), "POLAR_TOPIC_PREFIX": PREFIX}


def _cli(tmp_path, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(*args), env=_env(tmp_path), capture_output=True, text=True, timeout=timeout)


def _up_both(tmp_path) -> None:
    # Side by side, as two datacenters would: one broker start's time for both.
    procs = [subprocess.Popen(_cmd("up", "--cluster", n, "--secure", "--heap-mb", "256"), env=_env(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in ("eu", "center")]
    for p in procs:
        out, err = p.communicate(timeout=150)
        assert p.returncode == 0, err
        assert "secure  SASL_SSL" in out and f"topic   created {PREFIX}polar.calls" in out


def _mirror_flow(tmp_path, call_count: int, deadline: float) -> dict:
    """`infra status --json` until the eu -> center flow has mirrored ``call_count`` calls with lag 0."""
    st = {}
    while time.monotonic() < deadline:
        st = json.loads(_cli(tmp_path, "status", "--json", "--window", "0.5").stdout)
        flow = next(f for f in st["mirrors"][0]["flows"] if f["source"] == "eu")
        calls = flow.get("topics", {}).get(f"{PREFIX}polar.calls", {})
        if flow.get("lag") == 0 and calls.get("mirrored", 0) >= call_count:
            return st
        time.sleep(1)
    raise AssertionError(f"flow eu -> center not caught up: {json.dumps(st, indent=1)[-2000:]}")


def test_secured_clusters_mirror_over_tls_and_sasl_from_the_cli(tmp_path):
    base = Settings(data_dir=tmp_path, topic_prefix=PREFIX)
    try:
        _up_both(tmp_path)
        creds = {n: yaml.safe_load((tmp_path / "clusters" / n / "security" / "credentials.yaml").read_text())["kafka"]
                 for n in ("eu", "center")}
        assert creds["eu"]["admin"] != creds["center"]["admin"]  # each datacenter has its own users
        st = json.loads(_cli(tmp_path, "status", "--cluster", "eu", "--json").stdout)
        assert st["secure"] and st["kafka"]["up"]
        topics = _cli(tmp_path, "topics", "--cluster", "center")
        assert topics.returncode == 0, topics.stderr
        assert "applied" in _cli(tmp_path, "acls", "--cluster", "center").stdout

        printed = _cli(tmp_path, "mirror", "--from", "eu", "--to", "center", "--print-config")
        assert printed.returncode == 0, printed.stderr
        props = parse_properties(printed.stdout)
        assert props["eu.security.protocol"] == props["center.security.protocol"] == "SASL_SSL"
        assert props["eu.ssl.truststore.location"].endswith("clusters/eu/security/ca.pem")
        assert props["center.sasl.jaas.config"].startswith("${file:") and props["config.providers"] == "file"
        started = _cli(tmp_path, "mirror", "--from", "eu", "--to", "center", "--refresh", "2")
        assert started.returncode == 0, started.stderr
        mm = MirrorMaker(base, region="eu", center="center")
        carried = mm.config_file.read_text()
        for pw in (*creds["eu"].values(), *creds["center"].values()):
            assert pw not in carried and pw not in printed.stdout  # only the 0600 secrets file holds them
        assert mm.secrets_file.stat().st_mode & 0o077 == 0 and creds["eu"]["admin"] in mm.secrets_file.read_text()

        # The region's gateway, configured as a user would: home cluster + its principal (CA implied).
        gateway = Settings(data_dir=tmp_path, topic_prefix=PREFIX, home_cluster="eu", kafka_username="gateway",
                           kafka_password=creds["eu"]["gateway"])
        assert gateway.kafka_ca_file.endswith("clusters/eu/security/ca.pem")
        call = CallRecorded(session_id="eu-cli-s0", call_index=0, provider="engine", prompt_ids=[1, 2, 3])

        async def publish():
            async with Publisher(gateway) as pub:
                await pub.publish(call)
        asyncio.run(publish())

        deadline = time.monotonic() + 90
        got = []
        with RecordConsumer(cluster_admin(base, "center"), topics=["calls"], group_id="cli-mirror-check") as c:
            while not got and time.monotonic() < deadline:
                got = [r.record for r in c.poll(1.0) if r.record.event_id == call.event_id]
        assert got == [call], f"not mirrored; mm2 log:\n{mm.log_tail(30)}"

        st = _mirror_flow(tmp_path, 1, time.monotonic() + 60)
        assert st["mirrors"][0]["running"] and st["clusters"]["center"]["secure"]
        log = mm.log_file.read_text(errors="replace")
        assert not any(pw in log for pw in (*creds["eu"].values(), *creds["center"].values()))
    finally:
        pids = {}
        for n in ("eu", "center"):
            if read_cluster_state(base.data_dir, n):
                pids[n] = Cluster(base, n).status()["kafka"]["pid"]
        mm_pid = MirrorMaker(base, region="eu", center="center").pid()
        stop = _cli(tmp_path, "mirror", "--from", "eu", "--to", "center", "--stop")
        downs = [_cli(tmp_path, "down", "--cluster", n) for n in pids]
    assert stop.returncode == 0 and all(d.returncode == 0 and "kafka   stopped" in d.stdout for d in downs)
    assert mm_pid is None or not pid_alive(mm_pid, str(MirrorMaker(base, region="eu", center="center").config_file))
    for n, pid in pids.items():
        assert pid is None or not pid_alive(pid, str(tmp_path / "clusters" / n / "kafka" / "server.properties"))
