"""One setting for the address other machines reach this one at (Settings.advertised_host): every URL a
component started here announces uses it and every server listens where it can be reached; unset, a run
stays on loopback, its commands as before."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from infra.process import free_port
from infra.settings import Settings
from polarstream.driver.components import COMPONENTS, addresses, child_env, component_args
from polarstream.driver.config import RunConfig
from polarstream.driver.processes import Processes

SERVED = {"ui": "ui", "engine": "engine", "node": "gateway", "rollout": "rollout"}


def _all(settings: Settings, tmp_path: Path):
    cfg = RunConfig(run_dir=tmp_path / "run", run_id="r1")
    ports, urls = addresses(cfg, Processes(tmp_path / "logs", {}), settings)
    args = {name: component_args(name, cfg, settings, ports, urls, Path("/m"), "bwrap", tmp_path / "run")
            for name in COMPONENTS}
    return ports, urls, args


def test_one_machine_stays_on_loopback(tmp_path):
    settings = Settings(data_dir=tmp_path / "d")
    ports, urls, args = _all(settings, tmp_path)
    assert all(url == f"http://127.0.0.1:{ports[name]}" for name, url in urls.items())
    assert not any("--host" in a for a in args.values())  # each server's own default: loopback
    assert "POLAR_ADVERTISED_HOST" not in child_env(settings, tmp_path)


def test_an_advertised_host_is_in_every_announced_url_and_servers_listen_beyond_loopback(tmp_path):
    settings = Settings(data_dir=tmp_path / "d", advertised_host="trainer-box.lab")
    ports, urls, args = _all(settings, tmp_path)
    assert all(url == f"http://trainer-box.lab:{ports[name]}" for name, url in urls.items())
    for name in SERVED:
        i = args[name].index("--host")
        assert args[name][i + 1] == "0.0.0.0", (name, args[name])
    # the node and the trainer are handed the announced URLs, not loopback
    assert args["node"][args["node"].index("--engine-url") + 1] == urls["engine"]
    assert f"polar={urls['engine']}" in args["trainer"] and urls["gateway"] in args["trainer"]
    assert not any("127.0.0.1" in a for a in args.values() for a in a)
    # every component gets it (the trainer's weight-transfer rendezvous is announced at it: trainer/sync/syncer.py)
    assert child_env(settings, tmp_path)["POLAR_ADVERTISED_HOST"] == "trainer-box.lab"


def _this_machines_address() -> str | None:
    """An address of this machine other than loopback (the one its default route leaves from), if any."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET: no packet is sent, this only picks the route
            host = s.getsockname()[0]
    except OSError:
        return None
    return None if host.startswith("127.") else host


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_served_component_answers_at_the_advertised_address(infra, tmp_path):
    """The rollout server, started with the arguments and environment the driver writes for it, answers at
    this machine's non-loopback address: what another machine would call."""
    host = _this_machines_address()
    if host is None:
        pytest.skip("this machine has no address but loopback")
    settings = infra.settings.model_copy(update={"advertised_host": host, "admin_token": "s3cret-admin",
                                                 "session_secret": "s3cret-session"})
    cfg = RunConfig(run_dir=tmp_path / "run", run_id="r1")
    ports = {**dict.fromkeys(("engine", "gateway", "ui", "streams_metrics", "trainer_metrics"), 0), "rollout": free_port()}
    args = component_args("rollout", cfg, settings, ports, {}, Path("/m"), "bwrap", tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-m", "polarstream", *args], env={**os.environ, **child_env(settings, tmp_path)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://{host}:{ports['rollout']}/health"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, f"nothing answered at {url}"
            try:
                if httpx.get(url, timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
