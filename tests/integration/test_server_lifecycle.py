"""Server lifecycle: bad flags, readiness, SIGTERM cleanup, and a dead child taking the server down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import psutil
import pytest

from utils_process import running, wait_until

pytestmark = pytest.mark.slow  # starts a server (processes): the full suite runs it, the fast lane does not



def ipc_dirs_of(pid: int) -> set[str]:
    """Directories of the ipc:// socket files the main process has bound."""
    dirs = set()
    for conn in psutil.Process(pid).net_connections(kind="unix"):
        if conn.laddr and "engine-ipc-" in conn.laddr:
            dirs.add(os.path.dirname(conn.laddr))
    return dirs


@pytest.mark.parametrize("flags, needle", [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--page-size", "3"], "--page-size must be a power of two"),
    (["--port", "not-a-number"], "--port"),
    (["--schedule-policy", "bogus"], "--schedule-policy"),
    (["--decode-log-interval", "0"], "--decode-log-interval must be >= 1"),
    (["--chat-template", "no-such-template"], "--chat-template"),
])
def test_bad_flags_exit_2_with_a_message(flags, needle):
    result = subprocess.run([sys.executable, "-m", "engine.launch_server", "--device", "cpu", *flags],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert needle in result.stderr
    assert "Traceback" not in result.stderr


def test_port_in_use_fails_fast_without_children():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "engine.launch_server", "--device", "cpu",
                                 "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "already in use" in result.stderr


def test_serve_then_sigterm_stops_everything_and_exits_0(launch_server):
    server = launch_server()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    children = server.descendants()
    titles = [" ".join(c.cmdline()) for c in children]
    assert any("engine::scheduler_TP0" in t for t in titles), titles
    assert any("engine::detokenizer" in t for t in titles), titles
    assert psutil.Process(server.pid).cmdline()[0].startswith("engine::main")
    response = httpx.post(f"{server.url}/generate", timeout=60,
                          json={"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                     "ignore_eos": True}})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["meta_info"]["completion_tokens"] == 4
    assert body["meta_info"]["finish_reason"]["type"] == "length"
    ipc_dirs = ipc_dirs_of(server.pid)
    assert ipc_dirs and all(os.path.isdir(d) for d in ipc_dirs)

    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0, server.log()
    assert wait_until(lambda: not any(running(c) for c in children), 30)
    assert not any(os.path.exists(d) for d in ipc_dirs)


def test_ctrl_c_on_a_terminal_is_the_graceful_exit(launch_server):
    """Ctrl-C sends SIGINT to the whole foreground process group, children included. The result
    must be the documented graceful stop (exit 0, nothing left behind), not a child dying of
    KeyboardInterrupt and the server exiting 1 for a dead child."""
    server = launch_server(own_process_group=True)
    assert os.getpgid(server.pid) == server.pid
    children = server.descendants()
    assert len(children) >= 2 and all(os.getpgid(c.pid) == server.pid for c in children)
    ipc_dirs = ipc_dirs_of(server.pid)

    os.killpg(server.pid, signal.SIGINT)
    code = server.proc.wait(timeout=60)
    log = server.log()
    assert code == 0, log
    assert wait_until(lambda: not any(running(c) for c in children), 30)
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert "died with exit code" not in log, log
    assert not any(os.path.exists(d) for d in ipc_dirs)


def test_killed_scheduler_makes_server_exit_nonzero(launch_server):
    server = launch_server()
    scheduler = server.find_child("engine::scheduler_TP0")
    assert scheduler is not None, [c.cmdline() for c in server.descendants()]
    others = [c for c in server.descendants() if c.pid != scheduler.pid]
    ipc_dirs = ipc_dirs_of(server.pid)

    os.kill(scheduler.pid, signal.SIGKILL)
    assert server.proc.wait(timeout=60) != 0
    assert "Child process scheduler_TP0" in server.log() and "died with exit code" in server.log()
    assert wait_until(lambda: not any(running(c) for c in others), 30)
    assert not any(os.path.exists(d) for d in ipc_dirs)
