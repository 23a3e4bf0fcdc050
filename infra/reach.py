"""Fail fast, in one line, when a service a command needs is not there (or its port is taken).

A command calls these before it builds any client: Kafka clients retry a dead broker for as long as
their timeouts allow (and print a line per retry), uvicorn logs a traceback for a taken port. A TCP
connect answers in milliseconds and lets the message say which address was tried and how to start it.
Each check raises InfraError, which ``polarstream`` prints as one ``error: ...`` line.

A long-running component passes ``wait_s`` (``Settings.wait_for_s``): a deployment starts its parts in any
order, so a component started before Kafka, S3 or its engine waits for it, bounded, with one line saying
what it waits for, and only then gives up. A one-shot command does not wait.
"""

from __future__ import annotations

import ipaddress
import sys
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from .errors import InfraError
from .process import connect_error, port_in_use
from .settings import Settings

INFRA_HINT = "is it running? `polarstream infra up` starts the local one"
ENGINE_HINT = "is it running? `polarstream engine` starts one"
_DEFAULT_PORTS = {"http": 80, "https": 443, "s3": 443}


def _host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` (a ``PLAINTEXT://`` style prefix is ignored)."""
    address = address.split("://", 1)[-1]
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def _waiting(check: Callable[[], None], wait_s: float, poll_s: float = 1.0) -> None:
    """``check()`` until it passes or ``wait_s`` has gone by; the first failure is said once (stderr), the
    last one raised with how long it waited."""
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            return check()
        except InfraError as e:
            left = deadline - time.monotonic()
            if wait_s <= 0:
                raise
            if left <= 0:
                raise InfraError(f"{e} (waited {wait_s:.0f}s)") from None
            if not said:
                print(f"waiting up to {wait_s:.0f}s: {e}", file=sys.stderr, flush=True)
                said = True
            time.sleep(min(poll_s, left))


def require_kafka(settings: Settings, timeout: float = 3.0, wait_s: float = 0.0) -> None:
    """InfraError unless at least one bootstrap server of ``settings`` accepts connections (within
    ``wait_s``)."""
    _waiting(lambda: _kafka_answers(settings, timeout), wait_s)


def _kafka_answers(settings: Settings, timeout: float) -> None:
    reasons = []
    for address in filter(None, (a.strip() for a in settings.kafka_bootstrap.split(","))):
        try:
            host, port = _host_port(address)
        except ValueError:
            raise InfraError(f"kafka_bootstrap {settings.kafka_bootstrap!r}: expected host:port[,host:port...]") from None
        reason = connect_error(host, port, timeout)
        if reason is None:
            return
        reasons.append(reason)
    raise InfraError(f"cannot reach Kafka at {settings.kafka_bootstrap} ({', '.join(dict.fromkeys(reasons))}); {INFRA_HINT}")


def require_url(url: str, what: str, hint: str, timeout: float = 3.0, wait_s: float = 0.0) -> None:
    """InfraError naming ``what`` and ``url`` unless the URL's host and port accept connections (within
    ``wait_s``; a malformed URL at once)."""
    parts = urlsplit(url)
    try:
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise InfraError(f"{what} URL {url!r}: expected http://host:port")

    def check() -> None:
        reason = connect_error(parts.hostname, port, timeout)
        if reason is not None:
            raise InfraError(f"cannot reach {what} at {url} ({reason}); {hint}")

    _waiting(check, wait_s)


def require_storage(settings: Settings, url: str, wait_s: float = 0.0) -> None:
    """For an ``s3://`` URL, InfraError unless the settings' S3 endpoint answers (file:// needs nothing)."""
    if url.startswith("s3://"):
        require_url(settings.s3_endpoint_url, "S3", INFRA_HINT, wait_s=wait_s)


def require_free_port(port: int, host: str = "127.0.0.1") -> None:
    """InfraError when a server could not listen on host:port now (IPv6 hosts are left to the server)."""
    if port and ":" not in host and port_in_use(port, host):
        raise InfraError(f"port {port} on {host} is already in use; stop what holds it or choose another with --port")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (``localhost``, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname or 0.0.0.0: assume reachable
