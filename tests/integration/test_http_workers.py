"""--tokenizer-worker-num 2: two HTTP worker processes share the port, each with its own
TokenizerManager; every output row and control reply must reach the worker that waits for it.

Which worker serves a connection is found from the worker processes' sockets (psutil), so the
tests that need a request on each worker open connections until one lands there.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
from typing import Any, Dict, List, Optional

import httpx
import psutil
import pytest

from utils_process import running, wait_until

pytestmark = pytest.mark.slow  # starts a server (processes): the full suite runs it, the fast lane does not

SERVER_ARGS = ["--tokenizer-worker-num", "2"]
WORKERS = 2


def worker_processes(server) -> List[psutil.Process]:
    workers = [server.find_child(f"engine::http_worker_{k}") for k in range(WORKERS)]
    assert all(w is not None for w in workers), [c.cmdline() for c in server.descendants()]
    return workers  # type: ignore[return-value]


def worker_of(server, sock: socket.socket) -> int:
    """The index of the worker that accepted this client socket's connection."""
    client_port = sock.getsockname()[1]
    workers = worker_processes(server)
    found: List[int] = []

    def accepted() -> bool:
        for k, worker in enumerate(workers):
            for conn in worker.net_connections(kind="tcp"):
                if conn.raddr and conn.raddr.port == client_port and conn.laddr.port == server.port:
                    found.append(k)
                    return True
        return False

    assert wait_until(accepted, 30), "no worker accepted the connection"
    return found[0]


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=60)


def connect_to_worker(server, worker: int) -> socket.socket:
    """A connection served by `worker` (the kernel spreads connections over the workers)."""
    for _ in range(200):
        sock = connect(server)
        if worker_of(server, sock) == worker:
            return sock
        sock.close()
    raise AssertionError(f"no connection reached worker {worker} in 200 tries")


def send_request(sock: socket.socket, path: str, body: Dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    sock.sendall(head + data)


def read_response(sock: socket.socket, data: bytes = b"") -> tuple[int, bytes]:
    """Status and raw body (chunked framing left in) of a Connection: close response (`data`:
    what was read of it already)."""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def stream_outputs(body: bytes) -> List[Dict[str, Any]]:
    """The JSON events of a /generate stream (chunk-size lines and [DONE] skipped)."""
    events = []
    for line in body.split(b"\n"):
        line = line.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            events.append(json.loads(line[len(b"data: "):]))
    return events


def read_until(sock: socket.socket, needle: bytes) -> bytes:
    data = b""
    while needle not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    return data


def generate_body(prompt: str, max_new_tokens: int, rid: Optional[str] = None, stream: bool = False,
                  **sampling: Any) -> Dict[str, Any]:
    body: Dict[str, Any] = {"text": prompt, "stream": stream,
                            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, **sampling}}
    if rid is not None:
        body["rid"] = rid
    return body


def test_both_workers_serve_and_every_request_gets_its_own_output(server):
    prompts = [f"Request number {i} says" for i in range(8)]
    expected = [httpx.post(f"{server.url}/generate", json=generate_body(p, 12), timeout=60).json()["text"]
                for p in prompts]
    assert len(set(expected)) > 1  # different prompts, different outputs: a mixed-up row would show

    socks = [connect(server) for _ in range(32)]
    served_by = {worker_of(server, s) for s in socks}
    assert served_by == {0, 1}
    for j, sock in enumerate(socks):
        send_request(sock, "/generate", generate_body(prompts[j % 8], 12, rid=f"mixed-{j}", stream=j % 2 == 0))
    for j, sock in enumerate(socks):
        status, body = read_response(sock)
        assert status == 200, body
        if j % 2 == 0:
            outputs = stream_outputs(body)
            assert outputs and all(o["meta_info"]["id"] == f"mixed-{j}" for o in outputs)
            final = outputs[-1]
        else:
            final = json.loads(body[body.index(b"{"):body.rindex(b"}") + 1])
            assert final["meta_info"]["id"] == f"mixed-{j}"
        assert final["text"] == expected[j % 8], j
        assert final["meta_info"]["finish_reason"]["type"] == "length"


def test_openai_routes_on_each_worker(server):
    for worker in range(WORKERS):
        sock = connect_to_worker(server, worker)
        send_request(sock, "/v1/chat/completions", {
            "model": "engine-builtin", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
        status, body = read_response(sock)
        assert status == 200, body
        assert b"data: [DONE]" in body
        usage = [e for e in stream_outputs(body) if e.get("usage")]
        assert usage and usage[-1]["usage"]["completion_tokens"] == 5


def test_abort_from_the_other_worker_ends_the_stream(server):
    """/abort_request reaches the scheduler from any worker; the abort output goes back to the
    worker whose client waits for it."""
    long_sock = connect_to_worker(server, 0)
    send_request(long_sock, "/generate", generate_body("Count on", 1900, rid="long-one", stream=True,
                                                       ignore_eos=True))
    started = read_until(long_sock, b"data: ")  # it runs
    abort_sock = connect_to_worker(server, 1)
    send_request(abort_sock, "/abort_request", {"rid": "long-one"})
    status, body = read_response(abort_sock)
    assert status == 200, body
    status, body = read_response(long_sock, started)
    assert status == 200, body
    final = stream_outputs(body)[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert final["meta_info"]["completion_tokens"] < 1900


def test_control_calls_answer_the_worker_that_asked(server):
    for _ in range(2):
        for worker in range(WORKERS):
            sock = connect_to_worker(server, worker)
            send_request(sock, "/flush_cache", {})
            status, body = read_response(sock)
            assert status == 200 and b"Cache flushed" in body, body
            sock = connect_to_worker(server, worker)
            sock.sendall(b"GET /get_server_info HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            status, body = read_response(sock)
            assert status == 200, body
            assert b"internal_states" in body


@pytest.mark.slow
def test_every_worker_enforces_the_connection_limits(server):
    """Each worker serves with the same guarded protocol (http_protocol.py) and defaults: a request
    head longer than --http-max-header-bytes (64 KiB) gets a 431, a connection that sends nothing a
    408 at --http-header-timeout (15 s)."""
    silent = [connect_to_worker(server, k) for k in range(WORKERS)]
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: "
    for k in range(WORKERS):
        sock = connect_to_worker(server, k)
        sock.sendall(head + b"a" * (65536 + 1 - len(head)))  # all read before the answer: no reset
        status, body = read_response(sock)
        assert status == 431, body
    for sock in silent:
        status, body = read_response(sock)
        assert status == 408, body


def test_sigterm_ends_streams_and_stops_every_process(launch_server):
    server = launch_server(SERVER_ARGS)
    everything = server.descendants()
    assert len(worker_processes(server)) == WORKERS
    sock = connect(server)
    send_request(sock, "/generate", generate_body("Count on", 1900, stream=True, ignore_eos=True))
    started = read_until(sock, b"data: ")

    server.proc.send_signal(signal.SIGTERM)
    _, body = read_response(sock, started)
    # As with one process (docs/api.md, "Shutdown"): the stream's last event is the shutdown error.
    assert stream_outputs(body)[-1]["error"]["message"] == "The server is shutting down.", body[-500:]
    assert body.rstrip().endswith(b"data: [DONE]") or b"data: [DONE]" in body
    assert server.proc.wait(timeout=60) == 0, server.log()
    assert wait_until(lambda: not any(running(c) for c in everything), 30)
    assert "died with exit code" not in server.log()


@pytest.mark.parametrize("flags, needle", [
    (["--tokenizer-worker-num", "0"], "--tokenizer-worker-num must be >= 1"),
    (["--tokenizer-worker-num", "2", "--enable-metrics"], "--enable-metrics"),
])
def test_bad_worker_flags_exit_2(flags, needle):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "engine.launch_server", "--device", "cpu", *flags],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert needle in result.stderr


def test_a_dead_worker_stops_the_server(server):
    """On the module's server, which it ends: it must stay the module's last test that uses
    `server` (one server start fewer than a server of its own)."""
    victim = worker_processes(server)[1]
    others = [c for c in server.descendants() if c.pid != victim.pid]
    os.kill(victim.pid, signal.SIGKILL)
    assert server.proc.wait(timeout=60) == 1
    # /health answers once one worker serves: the other may still be starting (its death is then
    # reported as a failed start, also exit 1).
    assert re.search(r"Child process http_worker_1 \(\d+\) died (during startup )?with exit code", server.log())
    assert wait_until(lambda: not any(running(c) for c in others), 30)
