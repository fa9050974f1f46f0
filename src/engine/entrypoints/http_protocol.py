"""uvicorn's httptools protocol with the limits a server open to slow or hostile clients needs.

uvicorn closes a connection only when it stays idle after a response (`timeout_keep_alive`); a
client that connects and sends nothing, sends half a request head, or announces a body and never
sends it keeps its connection, and its file descriptor, for ever. With the descriptors of the
process used up, accept() fails and /health and /generate stop answering. httptools also buffers
a request head of any size. `GuardedHttpToolsProtocol` adds, per connection:

- a head deadline (`header_timeout`): from the connection (or the first byte of a following
  request) until the request head is complete; then 408 and close;
- a body deadline (`body_timeout`): from the end of the head until the body is complete; then
  close (the app sees a disconnect);
- a head size cap (`max_header_bytes`): 431 and close;
- a connection cap (`max_connections`) per HTTP process: a connection beyond it closes the oldest
  connection that waits on its client (idle between requests, or sending its head or body); only
  when every connection has a request being answered is the newcomer refused (503). A client
  holding many idle connections therefore cannot lock out others.

No deadline runs while a request is being answered: streams last as long as they need. The
limits come from ServerArgs (--http-*) and apply to every HTTP process alike, the
--tokenizer-worker-num workers included (each counts its own connections).
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import resource
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from engine.entrypoints.openai.utils import error_body
from engine.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Descriptors an HTTP process keeps for itself (ZMQ sockets, the tokenizer's files, pipes, logs)
# when --http-max-connections is derived from its open-file limit.
FD_RESERVE = 256
MAX_DEFAULT_CONNECTIONS = 65536
# The open-file limit a launched server asks for (up to the hard limit), as SGLang does.
TARGET_OPEN_FILES = 65536


@dataclass(frozen=True)
class HttpLimits:
    header_timeout: float
    body_timeout: float
    keep_alive_timeout: int
    max_header_bytes: int
    max_connections: int

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> HttpLimits:
        return cls(header_timeout=args.http_header_timeout, body_timeout=args.http_body_timeout,
                   keep_alive_timeout=args.http_keep_alive_timeout, max_header_bytes=args.http_max_header_bytes,
                   max_connections=args.http_max_connections or default_max_connections())


def default_max_connections() -> int:
    """What this process's open-file limit allows, less the descriptors it needs for itself."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_DEFAULT_CONNECTIONS
    return max(16, min(MAX_DEFAULT_CONNECTIONS, soft - min(FD_RESERVE, soft // 4)))


def raise_open_file_limit() -> None:
    """Raise the soft open-file limit towards TARGET_OPEN_FILES (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = TARGET_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, TARGET_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            logger.warning("Could not raise the open-file limit from %d to %d (%s): at most %d connections.",
                           soft, target, e, default_max_connections())


class ConnectionTable:
    """The open connections of one server, and which of them wait on their client (oldest first):
    those are the ones closed to make room."""

    def __init__(self) -> None:
        self._open: set[GuardedHttpToolsProtocol] = set()
        self._waiting: OrderedDict[GuardedHttpToolsProtocol, None] = OrderedDict()

    def opened(self, conn: GuardedHttpToolsProtocol) -> int:
        self._open.add(conn)
        self.waiting(conn)
        return len(self._open)

    def waiting(self, conn: GuardedHttpToolsProtocol) -> None:
        if conn in self._open:
            self._waiting.pop(conn, None)
            self._waiting[conn] = None

    def busy(self, conn: GuardedHttpToolsProtocol) -> None:
        self._waiting.pop(conn, None)

    def closed(self, conn: GuardedHttpToolsProtocol) -> None:
        self._open.discard(conn)
        self._waiting.pop(conn, None)

    def oldest_waiting(self, besides: GuardedHttpToolsProtocol) -> Optional[GuardedHttpToolsProtocol]:
        return next((conn for conn in self._waiting if conn is not besides), None)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """One connection; see the module docstring. Use `protocol_class(limits)`, which binds the
    limits and a connection table for one server."""

    limits: ClassVar[HttpLimits]
    table: ClassVar[ConnectionTable]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: Optional[asyncio.TimerHandle] = None
        self._in_head = True  # before a request's head is complete (idle between requests included)
        self._head_bytes = 0

    # ------------------------------------------------------------------ connection
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm(self.limits.header_timeout, self._head_timed_out)
        if self.table.opened(self) > self.limits.max_connections:
            self._make_room()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        self.table.closed(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # The head is fed at most up to the cap: httptools would buffer a head of any size.
        while data and self._in_head and not self.transport.is_closing():
            budget = self.limits.max_header_bytes - self._head_bytes
            if budget <= 0:
                self._reply_and_close(431, f"The request head is larger than the limit of "
                                           f"{self.limits.max_header_bytes} bytes.")
                return
            head, data = data[:budget], data[budget:]
            self._head_bytes += len(head)
            super().data_received(head)
        if data and not self.transport.is_closing():
            super().data_received(data)

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        if self._deadline is None:  # a request after an idle keep-alive connection
            self._arm(self.limits.header_timeout, self._head_timed_out)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        super().on_headers_complete()
        if not self.transport.is_closing():
            self._arm(self.limits.body_timeout, self._body_timed_out)  # on_message_complete disarms

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()
        self._in_head, self._head_bytes = True, 0
        self.table.busy(self)  # being answered: never closed to make room

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self.pipeline and self._answered():
            self.table.waiting(self)  # idle until the next request (uvicorn's keep-alive timer runs)

    # ------------------------------------------------------------------ limits
    def _answered(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _head_timed_out(self) -> None:
        self._deadline = None
        if not self._answered():
            # A pipelined head behind a response in progress: the response may take long.
            self._arm(self.limits.header_timeout, self._head_timed_out)
            return
        self._reply_and_close(408, f"The request head did not arrive within {self.limits.header_timeout:g} s.")

    def _body_timed_out(self) -> None:
        self._deadline = None
        self._reply_and_close(408, f"The request body did not arrive within {self.limits.body_timeout:g} s.")

    def _make_room(self) -> None:
        victim = self.table.oldest_waiting(besides=self)
        if victim is None:
            self._reply_and_close(503, f"The server holds {self.limits.max_connections} connections, all with a "
                                       "request in progress: retry later.")
            return
        victim._close("the connection limit was reached and it was the longest waiting on its client")

    def _arm(self, delay: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay, callback)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _close(self, reason: str) -> None:
        logger.debug("Closing the connection of %s: %s", self.client, reason)
        self._disarm()
        self.table.closed(self)
        self.transport.close()

    def _reply_and_close(self, status: int, message: str) -> None:
        """An error response written by hand, then close; only the close when a response of a
        request cycle has begun on this connection (the bytes would interleave)."""
        writing = bool(self.pipeline) or (self.cycle is not None and self.cycle.response_started
                                          and not self.cycle.response_complete)
        if writing:
            self._close(message)
            return
        body = json.dumps(error_body(message, status)).encode()
        head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        self.transport.write(head + body)
        self._close(message)


def protocol_class(limits: HttpLimits) -> type[GuardedHttpToolsProtocol]:
    """GuardedHttpToolsProtocol bound to `limits` and a connection table of its own (one server)."""
    bound = type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"limits": limits, "table": ConnectionTable()})
    return cast("type[GuardedHttpToolsProtocol]", bound)
