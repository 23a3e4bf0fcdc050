"""Process bookkeeping: Java checks, ports, and a pid file that stops exactly what it started."""

from __future__ import annotations

import socket
import sys

import pytest

from infra.errors import InfraError
from infra.process import (Service, free_port, parse_java_version, pid_alive, port_in_use, render_log4j,
                           require_free_ports)


@pytest.mark.parametrize("text, major", [
    ('openjdk version "17.0.15" 2025-04-15', 17),
    ('java version "1.8.0_402"', 8),
    ('openjdk version "21" 2023-09-19', 21),
])
def test_parse_java_version(text, major):
    assert parse_java_version(text) == major


def test_unreadable_java_version():
    with pytest.raises(InfraError, match="could not read the Java version"):
        parse_java_version("command not found")


def test_log4j_properties_route_to_the_file_with_per_logger_levels(tmp_path):
    text = render_log4j(tmp_path / "server.log", "WARN", {"a.b.C": "INFO", "state.change.logger": "ERROR"})
    props = dict(line.split(" = ", 1) for line in text.splitlines())
    assert props["appender.file.fileName"] == str(tmp_path / "server.log") and props["rootLogger.level"] == "WARN"
    levels = {props[k]: props[k.replace(".name", ".level")] for k in props if k.startswith("logger.") and k.endswith(".name")}
    assert levels == {"a.b.C": "INFO", "state.change.logger": "ERROR"}
    assert text.endswith("\n") and len(text.splitlines()) == len(props)  # one key per line, none repeated


def test_port_in_use_is_reported_with_its_name():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port_in_use(port)
        with pytest.raises(InfraError, match=f"kafka: port {port} \\(kafka_port\\) is already in use"):
            require_free_ports("kafka", {"kafka_port": port})
    assert not port_in_use(port)
    assert not port_in_use(free_port())


def _sleeper(tmp_path, name="svc") -> Service:
    marker = str(tmp_path / f"{name}.conf")
    return Service(name=name, pid_file=tmp_path / f"{name}.pid", log_file=tmp_path / f"{name}.log", marker=marker)


def test_service_spawn_stop_and_stale_pid_file(tmp_path):
    svc = _sleeper(tmp_path)
    cmd = [sys.executable, "-c", "import sys, time; print('hello', flush=True); time.sleep(60)", svc.marker]
    pid = svc.spawn(cmd, extra={"port": 1})
    assert svc.pid() == pid and svc.info()["port"] == 1
    svc.wait_ready(lambda: "hello" in svc.log_file.read_text(), timeout=20)
    assert svc.stop(timeout=5) is True
    assert not pid_alive(pid, svc.marker) and not svc.pid_file.exists()
    assert svc.stop() is False  # nothing left to stop

    # A pid file naming a live process that is not ours (another command line) is stale, not ours.
    svc.pid_file.write_text('{"pid": %d}' % __import__("os").getpid())
    assert svc.pid() is None and not svc.pid_file.exists()


def test_process_dying_during_startup_reports_its_log(tmp_path):
    svc = _sleeper(tmp_path, "crashy")
    svc.spawn([sys.executable, "-c", "import sys; print('bad config line 3'); sys.exit(2)", svc.marker], extra={})
    with pytest.raises(InfraError, match="crashy exited during startup(.|\n)*bad config line 3"):
        svc.wait_ready(lambda: False, timeout=20)


def test_die_with_parent_leaves_no_orphan(tmp_path):
    # A parent that starts a service with die_with_parent and is then SIGKILLed (a test session killed
    # by a timeout) must not leave its server running.
    import os
    import signal
    import subprocess
    import time

    marker = str(tmp_path / "orphan.conf")
    script = (
        "import sys, time; sys.path.insert(0, %r)\n"
        "from infra.process import Service\n"
        "from pathlib import Path\n"
        "svc = Service('orphan', Path(%r), Path(%r), %r)\n"
        "svc.spawn([sys.executable, '-c', 'import time; time.sleep(60)', %r], extra={}, die_with_parent=True)\n"
        "print('spawned', flush=True); time.sleep(60)\n"
    ) % (os.getcwd(), str(tmp_path / "o.pid"), str(tmp_path / "o.log"), marker, marker)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout.readline().strip() == "spawned"
    child = Service("orphan", tmp_path / "o.pid", tmp_path / "o.log", marker)
    pid = child.pid()
    assert pid is not None
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while pid_alive(pid, marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid, marker)


def test_free_ports_are_outside_the_ephemeral_range_and_bindable():
    """Outgoing connections take ephemeral ports; a server's port chosen there could be taken before it binds."""
    from infra.process import ephemeral_range


    lo, hi = ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert all(not lo <= p <= hi for p in ports) and len(set(ports)) > 40
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # free when handed out


def test_machine_cpu_counts_the_busy_share_of_every_core():
    """Over an interval in which this process spins, the machine kept at least some of a core busy and
    never more than all its cores (bench/driver.py's bound divides by this)."""
    import os
    import time

    from infra.process import machine_cpu

    before = machine_cpu()
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:  # a core busy for 0.3 s of CPU
        pass
    after = machine_cpu()
    busy, total, cores = after[0] - before[0], after[1] - before[1], after[2]
    assert cores == len(os.sched_getaffinity(0)) or cores == os.cpu_count()
    assert total > 0 and 0 < busy <= total
    assert 0 < busy / total * cores <= cores
