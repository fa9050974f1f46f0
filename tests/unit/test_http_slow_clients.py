"""Slow and idle clients cannot starve the HTTP server (http_protocol.py), on the real uvicorn stack.

One server process (slow_clients_server.py) with an open-file limit of NOFILE descriptors and
deadlines of DEADLINE seconds. More silent, half-headed and body-less connections than it has
descriptors must not stop /health and /generate from answering, and every one of them is closed
within its deadline; an oversized request head gets a 431; a stream that lasts longer than every
deadline still completes.
"""

from __future__ import annotations

import json
import os
import resource
import select
import socket
import subprocess
import sys
import time
from typing import Iterator, List, Tuple

import httpx
import pytest

pytestmark = pytest.mark.slow  # a server process and connections held to their deadlines

from utils_process import wait_until

from engine.utils.network_utils import get_free_port

NOFILE = 512
SLOW_CONNECTIONS = 600  # more than the server's descriptors
# --http-header-timeout and --http-body-timeout: long enough for the checks made while the slow
# connections are open to finish first on a loaded machine.
DEADLINE = 5.0
STEP = 0.75  # seconds per streamed token
MAX_HEADER_BYTES = 8192
SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_clients_server.py")
# The three ways of holding a connection without finishing a request.
SILENT = b""
HALF_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: "
NO_BODY = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
           b'{"text": ')


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = SLOW_CONNECTIONS + 256
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"the test holds {SLOW_CONNECTIONS} sockets; the open-file limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    port = get_free_port()
    proc = subprocess.Popen(
        [sys.executable, SERVER, "--nofile", str(NOFILE), "--step", str(STEP), "--device", "cpu", "--port", str(port),
         "--http-header-timeout", str(DEADLINE), "--http-body-timeout", str(DEADLINE),
         "--http-keep-alive-timeout", "2", "--http-max-header-bytes", str(MAX_HEADER_BYTES), "--log-level", "warning"])
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: proc.poll() is not None or _health(base) == 200, timeout=120), "no server"
        assert proc.poll() is None, "the server exited"
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if soft < need:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _health(base: str, timeout: float = 2.0) -> int:
    try:
        return httpx.get(f"{base}/health", timeout=timeout).status_code
    except httpx.HTTPError:
        return 0


def _open_slow(port: int, count: int) -> List[Tuple[socket.socket, bytes]]:
    conns = []
    for i in range(count):
        start = (SILENT, HALF_HEAD, NO_BODY)[i % 3]
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            if start:
                sock.sendall(start)
        except OSError:
            pass  # already closed by the server: counted as closed below
        conns.append((sock, start))
    return conns


def _closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed (EOF or reset); any answer before it is read and dropped."""
    while True:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        try:
            if not sock.recv(65536):
                return True
        except (ConnectionResetError, OSError):
            return True


def test_slow_connections_beyond_the_descriptors_do_not_starve_the_server(url: str) -> None:
    port = int(url.rsplit(":", 1)[1])
    conns = _open_slow(port, SLOW_CONNECTIONS)
    opened = time.monotonic()
    try:
        # While they are all open (none has reached its deadline yet, most are beyond the limit):
        assert _health(url, timeout=DEADLINE) == 200
        response = httpx.post(f"{url}/generate", json={"text": "ab", "sampling_params": {"max_new_tokens": 3}},
                              timeout=DEADLINE)
        assert response.status_code == 200 and response.json()["text"] == "cde"
        assert time.monotonic() - opened < DEADLINE, "the check must run before any deadline passed"
        # Each is closed within its deadline (plus scheduling slack on a loaded machine).
        pending = list(conns)

        def all_closed() -> bool:
            pending[:] = [c for c in pending if not _closed_by_server(c[0])]
            return not pending

        assert wait_until(all_closed, timeout=DEADLINE + 20, interval=0.1), \
            f"{len(pending)} slow connections still open, e.g. one that sent {pending[0][1]!r}"
    finally:
        for sock, _ in conns:
            sock.close()
    assert _health(url) == 200


def test_a_silent_connection_gets_a_408_at_its_deadline(url: str) -> None:
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE + 20) as sock:
        start = time.monotonic()
        answer = _read_until_closed(sock)
        waited = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:100]
    assert DEADLINE * 0.9 <= waited < DEADLINE + 15


def test_an_oversized_request_head_gets_a_431(url: str) -> None:
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        # One byte more than the cap: the server has read all of it when it answers and closes, so
        # the close is a FIN, not a reset that could drop the answer.
        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: "
        sock.sendall(head + b"a" * (MAX_HEADER_BYTES + 1 - len(head)))
        answer = _read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["code"] == 431 and str(MAX_HEADER_BYTES) in body["message"]
    assert _health(url) == 200


def test_a_head_within_the_cap_is_served(url: str) -> None:
    response = httpx.get(f"{url}/health", headers={"X-Big": "a" * (MAX_HEADER_BYTES - 512)}, timeout=10)
    assert response.status_code == 200


def test_a_stream_longer_than_every_deadline_completes(url: str) -> None:
    tokens = 8  # 8 x STEP = 6 s: past the head, body and keep-alive deadlines
    body = {"text": "ab", "stream": True, "sampling_params": {"max_new_tokens": tokens}}
    start = time.monotonic()
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=30) as response:
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert time.monotonic() - start > DEADLINE
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["text"] == "cdefghij"


def _read_until_closed(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)
