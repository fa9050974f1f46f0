"""ZMQ socket creation with the options every engine socket wants."""

from __future__ import annotations

import logging
from typing import Sequence, TypeVar, Union

import zmq

logger = logging.getLogger(__name__)

# The socket class of the context: a zmq.asyncio context makes sockets whose recv is awaitable.
_SocketT = TypeVar("_SocketT", bound=zmq.Socket)


def get_zmq_socket(context: zmq.Context[_SocketT], socket_type: int, endpoint: Union[str, Sequence[str]],
                   bind: bool) -> _SocketT:
    """Create a socket of `socket_type` and bind or connect it to `endpoint` (connect: or to each
    of several endpoints; a PULL then fair-queues their messages).

    High-water marks are unlimited: a PUSH that blocks because its peer is slow would stall the
    scheduler loop or the asyncio loop, and our volume (one message per scheduler iteration) is
    small. Linger is zero so that closing a socket at shutdown never waits for an absent peer.
    """
    socket = context.socket(socket_type)
    socket.setsockopt(zmq.LINGER, 0)
    if socket_type in (zmq.PUSH, zmq.DEALER, zmq.PUB, zmq.REQ, zmq.REP, zmq.ROUTER):
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.SNDBUF, -1)
    if socket_type in (zmq.PULL, zmq.DEALER, zmq.SUB, zmq.REQ, zmq.REP, zmq.ROUTER):
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.RCVBUF, -1)
    endpoints = [endpoint] if isinstance(endpoint, str) else list(endpoint)
    if bind:
        (only,) = endpoints
        socket.bind(only)
    else:
        for one in endpoints:
            socket.connect(one)
    logger.debug("zmq socket type=%s %s %s", socket_type, "bound to" if bind else "connected to", endpoint)
    return socket
