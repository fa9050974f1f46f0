"""Start PD deployments for tests and benchmarks: prefill and decode servers behind sglang-router.

`start_pd_router` runs `python -m sglang_router.launch_router --pd-disaggregation --prefill URL
BOOTSTRAP_PORT ... --decode URL ... --policy P` on free ports of 127.0.0.1; `wait_router_ready`
polls GET /workers until every worker is registered and healthy.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import httpx


@dataclass(frozen=True)
class PrefillEndpoint:
    url: str
    bootstrap_port: int


def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def prefill_server_args(bootstrap_port: int) -> List[str]:
    return ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port)]


def decode_server_args() -> List[str]:
    return ["--disaggregation-mode", "decode"]


def start_pd_router(prefills: Sequence[PrefillEndpoint], decodes: Sequence[str], policy: str, log_file: Any,
                    extra_args: Sequence[str] = ()) -> Tuple[subprocess.Popen, str]:
    """The router in PD mode on a free port (its metrics port too: several may run at once)."""
    port = find_free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--host", "127.0.0.1",
           "--port", str(port), "--prometheus-port", str(find_free_port()), "--policy", policy,
           "--log-level", "warn"]
    for prefill in prefills:
        cmd += ["--prefill", prefill.url, str(prefill.bootstrap_port)]
    for decode in decodes:
        cmd += ["--decode", decode]
    cmd += list(extra_args)
    return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def router_workers(router_url: str) -> List[Dict[str, Any]]:
    return httpx.get(f"{router_url}/workers", timeout=10).json()["workers"]


def wait_router_ready(proc: subprocess.Popen, router_url: str, num_workers: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with code {proc.returncode}")
        try:
            listed = router_workers(router_url)
            if len(listed) == num_workers and all(w.get("is_healthy", False) for w in listed):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.25)
    raise TimeoutError(f"the router did not register {num_workers} healthy workers in {timeout_s:.0f} s")


def stop_process(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
