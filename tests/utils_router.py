"""SGLang's router (`sglang-router`) as a process for the server suites: plain and PD mode.

The router registers its workers in the background after it starts, so a test waits for all of
them to be listed healthy (`start_router` does) before it sends anything. Every router listens on
free ports of 127.0.0.1, its metrics port too, so several can run at once.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import IO, Any, Dict, List, Optional, Sequence

import httpx
import pytest

from engine.utils.network_utils import get_free_port

try:
    import sglang_router  # noqa: F401

    HAVE_ROUTER = True
except ImportError:
    HAVE_ROUTER = False

needs_router = pytest.mark.skipif(not HAVE_ROUTER,
                                  reason="sglang-router is not installed (pip install -e '.[router]')")

ROUTER_READY_TIMEOUT_S = 60.0
LOG_TAIL_CHARS = 4000


@dataclass(frozen=True)
class PrefillEndpoint:
    url: str
    # None: `--prefill URL` alone; the router then sends `"bootstrap_port": null` and the servers
    # take their own --disaggregation-bootstrap-port (SGLang's PD example starts it that way).
    bootstrap_port: Optional[int]


def prefill_server_args(bootstrap_port: int) -> List[str]:
    return ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port)]


def decode_server_args() -> List[str]:
    return ["--disaggregation-mode", "decode"]


def router_workers(router_url: str) -> List[Dict[str, Any]]:
    """The router's view of its workers (GET /workers): url, is_healthy, load, metadata."""
    return httpx.get(f"{router_url}/workers", timeout=10).json()["workers"]


@dataclass
class RouterProcess:
    proc: subprocess.Popen
    url: str
    log: IO[bytes] = field(repr=False)

    def log_tail(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-LOG_TAIL_CHARS:]

    def wait_ready(self, num_workers: int, timeout_s: float = ROUTER_READY_TIMEOUT_S) -> None:
        """Poll until the router lists `num_workers` healthy workers; its log in the error if not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the router exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                listed = router_workers(self.url)
                if len(listed) == num_workers and all(w["is_healthy"] for w in listed):
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass  # not listening yet
            time.sleep(0.25)
        raise TimeoutError(f"the router did not list {num_workers} healthy workers in {timeout_s:.0f} s:\n"
                           f"{self.log_tail()}")

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


def _launch(args: Sequence[str], num_workers: int) -> RouterProcess:
    port = get_free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-port", str(get_free_port()), "--log-level", "warn", *args]
    log = tempfile.TemporaryFile()
    router = RouterProcess(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}",
                           log)
    try:
        router.wait_ready(num_workers)
    except BaseException:
        router.stop()
        raise
    return router


def start_router(worker_urls: Sequence[str], policy: str, extra_args: Sequence[str] = ()) -> RouterProcess:
    """The router in front of `worker_urls`, ready (every worker listed healthy)."""
    return _launch(["--worker-urls", *worker_urls, "--policy", policy, *extra_args], len(worker_urls))


def start_pd_router(prefills: Sequence[PrefillEndpoint], decodes: Sequence[str], policy: str,
                    extra_args: Sequence[str] = ()) -> RouterProcess:
    """The router in --pd-disaggregation mode, ready (every prefill and decode server listed healthy)."""
    args = ["--pd-disaggregation", "--policy", policy]
    for prefill in prefills:
        args += ["--prefill", prefill.url]
        if prefill.bootstrap_port is not None:
            args.append(str(prefill.bootstrap_port))
    for decode in decodes:
        args += ["--decode", decode]
    return _launch([*args, *extra_args], len(prefills) + len(decodes))
