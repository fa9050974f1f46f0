"""Network helpers: free TCP ports for servers and tests."""

from __future__ import annotations

import socket
from typing import Collection


def get_free_port(host: str = "127.0.0.1", exclude: Collection[int] = ()) -> int:
    """Return a TCP port that is free right now and not in `exclude` (ports picked earlier but not
    bound yet: the OS may hand a just-released port out again). A race with others is possible."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in exclude:
            return port


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
