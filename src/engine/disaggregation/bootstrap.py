"""The bootstrap server a prefill server runs, and the clients that talk to it.

The router tells both servers of a request the prefill's `bootstrap_host` and `bootstrap_port`;
that address is all a decode server knows of the prefill. Each prefill scheduler rank registers
its transfer endpoint here (SGLang's routes):

  PUT  /route     a rank registers: attn_tp_size, attn_tp_rank, rank_ip, rank_port, page_size,
                  kv_cache_dtype, plus our `endpoint`, `kv_layout` and `metadata_schema_version`.
  GET  /route     with every rank parameter -1 (or none): the server-wide information, with all
                  ranks; 503 until every rank has registered. With target_tp_rank=r: that rank.
  GET  /health    200 with this server's session id (a restarted prefill gets a new one, so a
                  decode server notices a restart it did not see as a missed heartbeat).
  POST /recompute a decode server re-bootstraps a request retracted by pause_generation: the
                  body (recompute.RecomputeReq, at most MAX_RECOMPUTE_BODY_BYTES) becomes a
                  prefill request of this server (202 once queued; 503 where nothing takes it).

It runs on a thread of the prefill's main process (a stdlib ThreadingHTTPServer).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
import uuid
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Callable, Dict, Optional, Tuple
from urllib.parse import parse_qs, urlparse

from engine.disaggregation import recompute
from engine.disaggregation.auth import HTTP_HEADER, check_http, http_mac


logger = logging.getLogger(__name__)

HTTP_TIMEOUT_S = 2.0
REGISTER_RETRIES = 50
REGISTER_RETRY_S = 0.1
# The largest answer a client reads (a full route answer of a 64-rank prefill is ~40 KB).
MAX_ANSWER_BYTES = 1 << 20
# The server's bounds: a registration body (a rank's is ~1 KB), seconds a connection may stay
# silent, and the worker threads (requests are tiny; a few serve every rank and heartbeat).
MAX_BODY_BYTES = 64 << 10
CONNECTION_TIMEOUT_S = 5.0
HTTP_WORKERS = 8
# Re-bootstraps forwarded to this prefill's /generate at once, and at most pending.
RECOMPUTE_THREADS = 64
MAX_PENDING_RECOMPUTES = 4096


class BootstrapUnavailable(RuntimeError):
    """The bootstrap server cannot be reached (connection refused, timeout, bad answer)."""


class _PooledHTTPServer(HTTPServer):
    """An HTTP server that hands connections to a fixed pool of threads, not a thread each.

    With a socket timeout per connection, idle or slow clients hold a worker for at most that
    long and the accept queue is bounded by the listen backlog.
    """

    daemon_threads = True

    def __init__(self, address: Tuple[str, int], handler: type, workers: int) -> None:
        super().__init__(address, handler)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bootstrap-http")

    def process_request(self, request: Any, client_address: Any) -> None:
        self._pool.submit(self._serve_one, request, client_address)

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - a broken client must not take a worker down
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class BootstrapServer:
    def __init__(self, host: str, port: int, tp_size: int, secret: Optional[str] = None,
                 submit: Optional[Callable[[Dict[str, Any]], bool]] = None) -> None:
        self.tp_size = tp_size
        # Hands a re-bootstrap's /generate body to this prefill server: False when it is too busy
        # (None: this bootstrap server takes no recompute, 503).
        self.submit = submit
        self.host = host
        self.session_id = uuid.uuid4().hex
        self.ranks: Dict[int, Dict[str, Any]] = {}
        self._lock = threading.Lock()
        key = secret.encode() if secret else None
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = CONNECTION_TIMEOUT_S  # a socket timeout: a silent client frees its worker

            def log_message(self, fmt: str, *args: Any) -> None:  # quiet: heartbeats every second
                logger.debug("bootstrap %s", fmt % args)

            def _authorized(self, body: bytes) -> bool:
                if key is None or check_http(key, self.command, self.path, body, self.headers.get(HTTP_HEADER)):
                    return True
                logger.warning("Bootstrap server: refused an unauthenticated %s %s from %s",
                               self.command, self.path[:200], self.client_address[0])
                self._reply(401, {"error": "PD bootstrap requests need the --disaggregation-secret MAC"})
                return False

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if not self._authorized(b""):
                    return
                url = urlparse(self.path)
                if url.path == "/health":
                    self._reply(200, {"status": "ok", "session_id": server.session_id})
                elif url.path == "/route":
                    self._reply(*server.route_info(parse_qs(url.query)))
                else:
                    self._reply(404, {"error": "no such route"})

            def _read_body(self, limit: int) -> Optional[bytes]:
                """The body, or None once an error answer went out (no length, too long)."""
                try:
                    length = int(self.headers.get("Content-Length", ""))
                except ValueError:
                    self._reply(411, {"error": "a request body needs a Content-Length"})
                    return None
                if not 0 <= length <= limit:
                    self.close_connection = True  # the body is not read
                    self._reply(413, {"error": f"the body is at most {limit} bytes"})
                    return None
                return self.rfile.read(length)

            def do_POST(self) -> None:  # noqa: N802
                body = self._read_body(recompute.MAX_RECOMPUTE_BODY_BYTES)
                if body is None or not self._authorized(body):
                    return
                if urlparse(self.path).path != "/recompute":
                    self._reply(404, {"error": "no such route"})
                    return
                self._reply(*server.recompute(body))

            def do_PUT(self) -> None:  # noqa: N802
                body = self._read_body(MAX_BODY_BYTES)
                if body is None or not self._authorized(body):
                    return
                if urlparse(self.path).path != "/route":
                    self._reply(404, {"error": "no such route"})
                    return
                try:
                    info = json.loads(body)
                    if not isinstance(info, dict):
                        raise TypeError("not a JSON object")
                    self._reply(*server.register(info))
                except (ValueError, KeyError, TypeError) as e:
                    self._reply(400, {"error": f"bad registration: {e}"})

            def _reply(self, status: int, body: Dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = _PooledHTTPServer((host, port), Handler, workers=HTTP_WORKERS)
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="bootstrap-server", daemon=True)
        self._thread.start()
        logger.info("Bootstrap server listening on %s:%d", host, self.port)

    def register(self, info: Dict[str, Any]) -> tuple[int, Dict[str, Any]]:
        rank = int(info["attn_tp_rank"])
        if int(info["attn_tp_size"]) != self.tp_size or not 0 <= rank < self.tp_size:
            return 400, {"error": f"rank {rank} of TP size {info['attn_tp_size']} does not belong to this "
                                  f"server (TP size {self.tp_size})"}
        with self._lock:
            self.ranks[rank] = dict(info)
        logger.info("Prefill rank %d registered its KV transfer endpoint %s", rank, info.get("endpoint"))
        return 200, {"status": "ok"}

    def recompute(self, body: bytes) -> tuple[int, Dict[str, Any]]:
        """Queue a re-bootstrap's prefill request (the KV goes to the room's published slots)."""
        try:
            req = recompute.decode(body)
        except ValueError as e:
            return 400, {"error": str(e)}
        if self.submit is None:
            return 503, {"error": "this bootstrap server takes no recompute requests"}
        host = self.host if self.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        if not self.submit(recompute.generate_body(req, host, self.port)):
            return 503, {"error": f"more than {MAX_PENDING_RECOMPUTES} recompute requests are pending"}
        logger.debug("Recompute of room %d queued (%d tokens)", req.room, len(req.input_ids))
        return 202, {"status": "queued"}

    def route_info(self, query: Dict[str, list]) -> tuple[int, Dict[str, Any]]:
        target = int(query.get("target_tp_rank", ["-1"])[0])
        with self._lock:
            ranks = dict(self.ranks)
        if target >= 0:
            if target not in ranks:
                return 404, {"error": f"prefill TP rank {target} is not registered"}
            info = ranks[target]
            return 200, {"rank_ip": info["rank_ip"], "rank_port": info["rank_port"], "endpoint": info["endpoint"]}
        if len(ranks) < self.tp_size:
            return 503, {"error": f"{len(ranks)} of {self.tp_size} prefill ranks registered"}
        first = ranks[0]
        return 200, {
            "attn_tp_size": self.tp_size, "attn_dp_size": 1, "pp_size": 1,
            "page_size": first["page_size"], "kv_cache_dtype": first["kv_cache_dtype"],
            "follow_bootstrap_room": True, "session_id": self.session_id,
            "metadata_schema_version": first["metadata_schema_version"],
            "ranks": {str(r): ranks[r] for r in sorted(ranks)},
        }

    def close(self) -> None:
        if isinstance(self.submit, LocalGenerateForwarder):
            self.submit.close()
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=2.0)


class LocalGenerateForwarder:
    """Posts re-bootstrap requests to this prefill server's own /generate (bootstrap server side).

    Each post waits until the prefill finished and sent the KV, so they run on a pool of threads;
    at most MAX_PENDING_RECOMPUTES wait or run at once (more are refused). A failure is logged:
    the decode side's waiting timeout ends that request (it learns nothing else from here).
    """

    def __init__(self, url: str, api_key: Optional[str], timeout: float) -> None:
        self.url = url.rstrip("/") + "/generate"
        self.api_key = api_key
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(max_workers=RECOMPUTE_THREADS, thread_name_prefix="pd-recompute")
        self._lock = threading.Lock()
        self._pending = 0

    def __call__(self, body: Dict[str, Any]) -> bool:
        with self._lock:
            if self._pending >= MAX_PENDING_RECOMPUTES:
                return False
            self._pending += 1
        self._pool.submit(self._post, body)
        return True

    def _post(self, body: Dict[str, Any]) -> None:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(), method="POST", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                response.read(MAX_ANSWER_BYTES)
        except urllib.error.HTTPError as e:
            logger.warning("Recompute of room %s refused by this prefill server: %d %s", body.get("bootstrap_room"),
                           e.code, e.read(512).decode(errors="replace"))
        except (urllib.error.URLError, OSError, ValueError) as e:
            logger.warning("Recompute of room %s failed: %s", body.get("bootstrap_room"), e)
        finally:
            with self._lock:
                self._pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class BootstrapClient(ABC):
    """What the transfer managers ask of a prefill's bootstrap server."""

    @abstractmethod
    def register(self, addr: str, info: Dict[str, Any]) -> None:
        """A prefill rank registers itself (retried until the server answers)."""

    @abstractmethod
    def fetch(self, addr: str) -> Optional[Dict[str, Any]]:
        """Server-wide information; None while ranks are missing; BootstrapUnavailable if unreachable."""

    @abstractmethod
    def session(self, addr: str) -> Optional[str]:
        """The server's session id (heartbeat), or None when it does not answer."""

    @abstractmethod
    def recompute(self, addr: str, req: recompute.RecomputeReq) -> None:
        """Ask the prefill at `addr` to recompute a request's KV; BootstrapUnavailable when it
        cannot be reached or refuses."""


class HttpBootstrapClient(BootstrapClient):
    def __init__(self, timeout: float = HTTP_TIMEOUT_S, secret: Optional[str] = None) -> None:
        self.timeout = timeout
        self._key = secret.encode() if secret else None

    def _call(self, method: str, url: str, body: Optional[Dict[str, Any]] = None,
              raw_body: Optional[bytes] = None) -> tuple[int, Dict[str, Any]]:
        data = json.dumps(body).encode() if body is not None else raw_body
        headers = {"Content-Type": "application/json"}
        if self._key is not None:
            parsed = urlparse(url)
            target = parsed.path + (f"?{parsed.query}" if parsed.query else "")
            headers[HTTP_HEADER] = http_mac(self._key, method, target, data or b"")
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                # Whatever answers at a client-named address is bounded like any input.
                raw = response.read(MAX_ANSWER_BYTES + 1)
                answer = json.loads(raw or b"{}")
        except urllib.error.HTTPError as e:
            return e.code, {}
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise BootstrapUnavailable(f"bootstrap server {url} unreachable: {e}") from None
        if len(raw) > MAX_ANSWER_BYTES or not isinstance(answer, dict):
            raise BootstrapUnavailable(f"bootstrap server {url} answered something else than a bootstrap answer")
        return response.status, answer

    def register(self, addr: str, info: Dict[str, Any]) -> None:
        last: Optional[Exception] = None
        for _ in range(REGISTER_RETRIES):
            try:
                status, body = self._call("PUT", f"http://{addr}/route", info)
                if status == 200:
                    return
                raise RuntimeError(f"bootstrap server {addr} refused the registration: {status} {body}")
            except BootstrapUnavailable as e:
                last = e
                time.sleep(REGISTER_RETRY_S)
        raise RuntimeError(f"could not register with the bootstrap server at {addr}: {last}")

    def fetch(self, addr: str) -> Optional[Dict[str, Any]]:
        status, body = self._call(
            "GET", f"http://{addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1")
        if status == 503:
            return None
        if status != 200:
            raise BootstrapUnavailable(f"bootstrap server {addr} answered {status}")
        return body

    def session(self, addr: str) -> Optional[str]:
        try:
            status, body = self._call("GET", f"http://{addr}/health")
        except BootstrapUnavailable:
            return None
        return body.get("session_id") if status == 200 else None

    def recompute(self, addr: str, req: recompute.RecomputeReq) -> None:
        status, body = self._call("POST", f"http://{addr}/recompute", raw_body=recompute.encode(req))
        if status != 202:
            raise BootstrapUnavailable(f"the prefill's bootstrap server at {addr} refused the recompute: {status} "
                                       f"{str(body.get('error', ''))[:200]}")
