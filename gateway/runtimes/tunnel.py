"""The gateway's only way into a network-isolated sandbox: a unix socket, relayed to TCP on both ends.

A sandbox with its own network namespace has nothing but an empty loopback, so it can reach no address
at all. The node exposes the gateway as a unix socket (``serve_unix_to_tcp``) and binds that socket
into the sandbox; inside, this file runs as the sandbox's first process (``python3 tunnel.py --listen
127.0.0.1:PORT --unix SOCK -- harness argv...``): it listens on the namespace's loopback, relays every
connection to the socket, starts the harness and exits with its status. So the harness dials an
ordinary ``http://127.0.0.1:PORT`` and every other address stays unreachable.

A container task's image may have no python, so there the node runs this file itself, on the host, in
the container's network namespace only (``--netns /proc/PID/ns/net``, no program: it relays until
killed, and dies with the node): it sees the host's socket path and the container's loopback. With
``--when-told`` it starts (the interpreter, the namespace) ahead of the harness run and listens only once
a line ``host:port`` comes on its stdin: its start is off the run's path, and nothing in the container
can reach the gateway before the run.

Standard library only: it runs under the sandbox's system python, without the project installed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.close()
        except OSError:
            pass


async def _splice(client_r, client_w, upstream) -> None:
    try:
        up_r, up_w = await upstream()
    except OSError:
        client_w.close()
        return
    await asyncio.gather(_pipe(client_r, up_w), _pipe(up_r, client_w))


async def serve_tcp_to_unix(host: str, port: int, sock_path: str) -> asyncio.AbstractServer:
    """Listen on TCP host:port and relay each connection to the unix socket (inside the sandbox)."""
    return await asyncio.start_server(lambda r, w: _splice(r, w, lambda: asyncio.open_unix_connection(sock_path)), host, port)


async def serve_unix_to_tcp(sock_path: str, host: str, port: int) -> asyncio.AbstractServer:
    """Listen on a unix socket and relay each connection to TCP host:port (on the node, outside)."""
    server = await asyncio.start_unix_server(lambda r, w: _splice(r, w, lambda: asyncio.open_connection(host, port)), sock_path)
    os.chmod(sock_path, 0o777)  # the sandbox user (uid 1000 in its namespace) must be able to connect
    return server


def enter_netns(path: str) -> None:
    """Move this process into the network namespace at ``path`` (before any socket is made), and have
    the kernel kill it when its parent (the node) dies, so no relay outlives the session's owner."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns {path}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


async def _supervise(listen: str, sock_path: str, argv: list[str]) -> int:
    host, _, port = listen.rpartition(":")
    server = await serve_tcp_to_unix(host or "127.0.0.1", int(port), sock_path)
    if not argv:  # relay only: until SIGTERM
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        print("ready", flush=True)
        await stop.wait()
        server.close()
        return 0
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, proc.send_signal, sig)
    rc = await proc.wait()
    server.close()
    return rc if rc >= 0 else 128 - rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", default="", help="host:port to listen on inside the sandbox")
    ap.add_argument("--unix", required=True, help="unix socket that reaches the gateway")
    ap.add_argument("--netns", default="", help="enter this network namespace first (a container's)")
    ap.add_argument("--when-told", action="store_true", help="listen at the host:port read from stdin, once it comes")
    ap.add_argument("argv", nargs=argparse.REMAINDER, help="-- program and arguments")
    ns = ap.parse_args()
    argv = ns.argv[1:] if ns.argv[:1] == ["--"] else ns.argv
    if not argv and not ns.netns:
        ap.error("no program given after --")
    if ns.netns:
        enter_netns(ns.netns)
    if ns.when_told:
        ns.listen = sys.stdin.readline().strip()
        if not ns.listen:
            return 0  # not needed after all (the session ended first)
    try:
        return asyncio.run(_supervise(ns.listen, ns.unix, argv))
    except FileNotFoundError as e:
        print(f"tunnel: cannot start {argv[0]}: {e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
