"""How the transfer managers move messages and run background work.

`Transport`: an endpoint that receives messages (handed to one handler) and sends them to other
endpoints. `JobRunner`: runs background jobs (gathering and sending KV, bootstrap lookups) off
the scheduler thread, in submission order.

The tcp backend uses `ZmqTransport` (a PULL socket with a listener thread; PUSH sockets owned by
the IO runner's thread, since ZMQ sockets are not thread-safe) and `ThreadJobRunner`s. The
loopback backend (loopback.py) implements both in-process, delivered by an explicit pump().
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import queue
import socket
import threading
from collections import OrderedDict
from abc import ABC, abstractmethod
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

from engine.disaggregation.auth import MAC_BYTES, frames_mac

logger = logging.getLogger(__name__)

Handler = Callable[[List[Any]], None]
# How long the listener waits for a message before checking whether it should stop.
LISTENER_POLL_MS = 100
# Peers a transport keeps a PUSH socket for (a decode rank talks to a few prefill ranks, a
# prefill rank to the decode ranks of its requests in flight).
MAX_PUSH_SOCKETS = 1024


class TransportError(RuntimeError):
    """A message could not be handed to the network (the peer is gone or not accepting)."""


class Transport(ABC):
    endpoint: str

    @abstractmethod
    def start(self, handler: Handler) -> None:
        """Deliver every received message (a list of frames) to `handler`."""

    @abstractmethod
    def send(self, endpoint: str, frames: Sequence[Any]) -> None:
        """Queue a message for `endpoint` without blocking; TransportError if impossible."""

    def allow_peer(self, endpoint: str) -> None:
        """Accept messages from `endpoint` (a peer learnt from a bootstrap server)."""

    def forget(self, endpoint: str) -> None:
        """Drop whatever is kept for a peer that went away."""

    def close(self) -> None:
        pass


class JobRunner(ABC):
    @abstractmethod
    def submit(self, job: Callable[[], None]) -> None:
        """Run `job` later, after every job submitted before it."""

    def close(self) -> None:
        pass


class ThreadJobRunner(JobRunner):
    """One daemon thread that runs jobs in order; a failing job is logged, the next one runs."""

    def __init__(self, name: str) -> None:
        self._jobs: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # noqa: BLE001 - a job owns its error reporting; this is the backstop
                logger.exception("A KV transfer background job failed")

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5.0)


class ZmqTransport(Transport):
    """A PULL socket bound on `host` (random port) and lazily connected PUSH sockets.

    Every message travels as [envelope, *frames]; the envelope is an HMAC of the rest (zeros
    without a secret) followed by the sender's endpoint. The receiver drops a message whose MAC
    does not match, any frame larger than `max_frame_bytes` (ZMQ's MAXMSGSIZE: the peer is
    disconnected before the frame is buffered), and with `known_senders_only` a message from an
    endpoint no one vouched for with `allow_peer` (decode: the prefills learnt from bootstrap).
    """

    def __init__(self, host: str, secret: Optional[str] = None, max_frame_bytes: int = -1,
                 known_senders_only: bool = False) -> None:
        import zmq

        self._zmq = zmq
        self._secret = secret.encode() if secret else None
        self._known_senders_only = known_senders_only
        self._allowed: Set[bytes] = set()
        self._allowed_lock = threading.Lock()
        self.rejected = 0  # messages dropped (bad MAC, unknown sender, malformed envelope)
        self._context = zmq.Context(1)
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        if _is_ipv6(host):
            self._pull.setsockopt(zmq.IPV6, 1)
        bracketed = f"[{host}]" if _is_ipv6(host) else host
        port = self._pull.bind_to_random_port(f"tcp://{bracketed}")
        self.endpoint = f"tcp://{bracketed}:{port}"
        self._sender = self.endpoint.encode()
        self._push: "OrderedDict[str, Any]" = OrderedDict()  # least recently used first
        self._stop = threading.Event()
        self._listener: Optional[threading.Thread] = None

    def allow_peer(self, endpoint: str) -> None:
        with self._allowed_lock:
            self._allowed.add(endpoint.encode())

    def start(self, handler: Handler) -> None:
        def listen() -> None:
            while not self._stop.is_set():
                try:
                    if not self._pull.poll(LISTENER_POLL_MS):
                        continue
                    frames = self._pull.recv_multipart(copy=False)
                except self._zmq.ZMQError:
                    if self._stop.is_set():
                        return
                    raise
                buffers = [f.buffer for f in frames]
                if not self._accept(buffers):
                    self.rejected += 1
                    continue
                try:
                    handler(buffers[1:])
                except Exception:  # noqa: BLE001 - one bad message must not stop the listener
                    logger.exception("Failed to handle a KV transfer message")

        self._listener = threading.Thread(target=listen, name="kv-transfer-listener", daemon=True)
        self._listener.start()

    def _accept(self, buffers: List[Any]) -> bool:
        if len(buffers) < 2 or len(buffers[0]) < MAC_BYTES:
            logger.warning("Dropped a KV transfer message without an envelope")
            return False
        envelope = bytes(buffers[0])
        mac, sender = envelope[:MAC_BYTES], envelope[MAC_BYTES:]
        if self._secret is not None and not hmac.compare_digest(mac, frames_mac(self._secret, sender, buffers[1:])):
            logger.warning("Dropped a KV transfer message with a bad MAC (claimed sender %r): "
                           "--disaggregation-secret differs or the sender is not a PD server", sender[:200])
            return False
        if self._known_senders_only:
            with self._allowed_lock:
                known = sender in self._allowed
            if not known:
                logger.warning("Dropped a KV transfer message from %r, not a prefill learnt from a bootstrap server",
                               sender[:200])
                return False
        return True

    def send(self, endpoint: str, frames: Sequence[Any]) -> None:
        zmq = self._zmq
        sock = self._push.get(endpoint)
        if sock is None:
            sock = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # KV frames are bounded by the requests in flight
            if "[" in endpoint:
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(endpoint)
            self._push[endpoint] = sock
            # Destinations name the endpoints: bound the sockets (each a connection and its
            # buffers) so that many distinct names cannot exhaust file descriptors.
            while len(self._push) > MAX_PUSH_SOCKETS:
                _, oldest = self._push.popitem(last=False)
                oldest.close(linger=0)
        self._push.move_to_end(endpoint)
        mac = frames_mac(self._secret, self._sender, frames) if self._secret is not None else bytes(MAC_BYTES)
        try:
            sock.send_multipart([mac + self._sender, *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise TransportError(f"cannot send to {endpoint}: {e}") from None

    def forget(self, endpoint: str) -> None:
        with self._allowed_lock:
            self._allowed.discard(endpoint.encode())
        sock = self._push.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.join(timeout=2.0)
        for sock in self._push.values():
            sock.close(linger=0)
        self._push.clear()
        self._pull.close(linger=0)
        self._context.term()


def _is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host.strip("[]")), ipaddress.IPv6Address)
    except ValueError:
        return False


def advertised_host(host: Optional[str], server_host: str) -> str:
    """The address peers use to reach this server's transfer socket.

    --disaggregation-host if given, else --host unless it is a wildcard, else the address of the
    interface that routes outwards (a UDP connect sends nothing), else the loopback address.
    """
    if host:
        return host
    if server_host not in ("0.0.0.0", "::", ""):
        return server_host
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
