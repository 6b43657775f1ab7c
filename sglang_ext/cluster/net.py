"""Ports and HTTP probes the cluster (and the eval harness) use: free ports, whether a server's
log says its port was taken, whether a server's process is the one listening on its port, and a
GET that answers None instead of raising."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports (all held open until every one is chosen, so none repeats)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def port_taken(log: str) -> bool:
    """Whether a server's log says it could not bind its port (uvicorn's message, or SGLang's
    router's: smg's "Failed to bind the HTTP listener ... Address already in use")."""
    return (("error while attempting to bind" in log and "address already in use" in log)
            or ("Failed to bind" in log and "Address already in use" in log))


def listens_on(pid: int, port: int) -> bool:
    """Whether process `pid` or one of its descendants listens on TCP `port`. A server answering
    on its port is only this caller's server if so: between `free_port()` and the server's bind,
    another server started beside it may take the port, and then answers there first."""
    import psutil

    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    for proc in tree:
        try:   # `net_connections` from psutil 6, `connections` before (setup.py: psutil>=5.9)
            listing = getattr(proc, "net_connections", None) or proc.connections
            conns = listing(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns):
            return True
    return False


def get_text(url: str) -> str | None:
    """The body of a 200 answer to GET `url` (10 s timeout), else None."""
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.read().decode("utf-8", "replace") if resp.status == 200 else None
    except (urllib.error.URLError, OSError):
        return None


def get_ok(url: str) -> bool:
    return get_text(url) is not None
