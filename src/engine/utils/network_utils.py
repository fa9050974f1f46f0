"""Network helpers: free TCP ports for servers and tests."""

from __future__ import annotations

import socket


def get_free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free right now (the OS picks it; a race with others is possible)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        return sock.getsockname()[1]


def is_port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when a server can listen on the port now. SO_REUSEADDR, as uvicorn binds: connections
    of a server that just died (TIME_WAIT) must not keep its replacement from the same port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
