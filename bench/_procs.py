"""Server processes for the benchmarks: start one with its log, wait for its HTTP port, stop them all.

Shared by bench/gateway.py, bench/fuzz.py and bench/_profile.py (the leading underscore keeps
bench/run_all.py from running it as a benchmark). Each server gets its own session, so a benchmark's
Ctrl-C does not reach it and the cleanup in ``stop`` decides when it ends.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def spawn(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """Start ``cmd`` in its own session, stdout and stderr to ``log``, in ``log``'s folder."""
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            cwd=log.parent, start_new_session=True)


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    """Return once ``url`` answers below 500; raise if ``proc`` exits first or ``timeout`` passes."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(map(str, proc.args[:5]))} exited with {proc.returncode} (waiting for {url})")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up in {timeout:.0f}s")


def stop(procs: list[subprocess.Popen], timeout: float) -> None:
    """Terminate every process still running, then kill those not gone within ``timeout`` seconds each."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()


def kafka_for_bench(bootstrap: str, tmp: Path, prefix: str, *, quick_jit: bool = True):
    """(Settings, broker or None): the running Kafka at ``bootstrap`` under a fresh topic prefix, or a
    single-node broker of our own on free ports (data in ``tmp``); the topics exist either way.

    ``quick_jit`` starts the broker's JVM with C1 only (seconds faster to start); a benchmark that times
    each acknowledgement passes False, so the broker runs the JIT a deployed one runs."""
    from infra.kafka import KafkaBroker
    from infra.process import free_port
    from infra.settings import Settings
    from infra.topics import ensure_topics

    kafka = None
    if bootstrap:
        settings = Settings(kafka_bootstrap=bootstrap, topic_prefix=f"{prefix}{int(time.time())}.", data_dir=tmp)
    else:
        kport = free_port()
        settings = Settings(kafka_port=kport, kafka_controller_port=free_port(), kafka_bootstrap=f"127.0.0.1:{kport}",
                            data_dir=tmp, topic_prefix=f"{prefix}.")
        kafka = KafkaBroker(settings, die_with_parent=True, quick_jit=quick_jit)
    try:
        if kafka is not None:
            kafka.start()
        ensure_topics(settings)
    except BaseException:
        if kafka is not None:
            kafka.stop()  # a half-started broker must not outlive the failed benchmark
        raise
    return settings, kafka


def server_env(settings, tmp: Path) -> dict[str, str]:
    """Environment for a ``polarstream`` server process: the benchmark's Kafka, topics and data folder."""
    return {"POLAR_KAFKA_BOOTSTRAP": settings.kafka_bootstrap, "POLAR_TOPIC_PREFIX": settings.topic_prefix,
            "POLAR_DATA_DIR": str(tmp), "PYTHONPATH": str(ROOT)}
