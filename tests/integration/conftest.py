"""Real-server fixtures: `python -m engine.launch_server` as a subprocess on a free port.

`server` (module-scoped) starts one server per test module with the built-in model on the CPU;
a module may set `SERVER_ARGS = [...]` to add flags and `SERVER_ENV = {...}` to add environment
variables. `server_url` is its base URL.
`launch_server` is a factory for tests that need their own server (lifecycle tests); every server
started through it is stopped at the end of the test, whatever happens.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import httpx
import psutil
import pytest

from engine.utils.network_utils import get_free_port

def pytest_ignore_collect(collection_path, config: pytest.Config) -> Optional[bool]:
    """The fast lane (`-m "not slow"`) does not import these modules at all: every one of them is
    marked slow (tests/unit/test_fast_lane.py checks that), so the lane would deselect all their
    tests after paying for their imports (openai, schemathesis, sentence-transformers: about a
    quarter of the lane's collection CPU). Any other marker expression collects them as usual."""
    if " ".join(str(config.getoption("markexpr") or "").split()) == "not slow":
        return True
    return None


STARTUP_TIMEOUT_S = float(os.environ.get("ENGINE_TEST_STARTUP_TIMEOUT", "240"))
# Every test server runs the idle memory self-check strictly: a leak kills it (non-zero exit).
BASE_ARGS = ["--device", "cpu", "--max-total-tokens", "8192", "--log-level", "warning", "--strict-memory-check"]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: str
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-8000:]
        except OSError:
            return ""

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def find_child(self, title: str) -> Optional[psutil.Process]:
        """The descendant whose command line (its process title) contains `title`."""
        for child in self.descendants():
            try:
                if title in " ".join(child.cmdline()):
                    return child
            except psutil.NoSuchProcess:
                continue
        return None

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        # One client for the whole wait: a client per poll builds a TLS context each time (tens of
        # ms of CPU taken from the starting server); a short interval: the port accepts (and queues)
        # connections from the start, so a poll costs little.
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with code {self.proc.returncode} during startup:\n{self.log()}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        raise RuntimeError(f"server not healthy after {timeout:.0f} s:\n{self.log()}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL of the whole tree if it does not exit in time."""
        if self.proc.poll() is None:
            leftovers = self.descendants()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            for child in leftovers:
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass


def post_greedy(url: str, input_ids, max_new_tokens: int, **extra):
    """POST /generate of token ids (one prompt or a batch), greedy, exactly max_new_tokens each;
    `extra` goes into the body (lora_path, ...). The response, unchecked."""
    import httpx

    body = {"input_ids": input_ids, **extra,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
    return httpx.post(f"{url}/generate", json=body, timeout=120)


# Every server's log file, removed when the session ends (a failure has quoted it by then).
_SERVER_LOGS: list[str] = []


@pytest.fixture(scope="session", autouse=True)
def remove_server_logs() -> Iterator[None]:
    yield
    for path in _SERVER_LOGS:
        try:
            os.unlink(path)
        except OSError:
            pass


def start_server_process(extra_args: Sequence[str] = (), wait: bool = True,
                         own_process_group: bool = False, port: Optional[int] = None,
                         env: Optional[dict] = None) -> ServerProcess:
    """`own_process_group`: start the server as the leader of a new process group (as a shell
    starts a foreground job), so a test can signal the whole group the way Ctrl-C does.
    `port`: a given port (a restart at the same address); `env`: extra environment variables."""
    port = port or get_free_port()
    fd, log_path = tempfile.mkstemp(prefix="engine-server-", suffix=".log")
    _SERVER_LOGS.append(log_path)
    args = [sys.executable, "-m", "engine.launch_server", "--port", str(port), *BASE_ARGS, *extra_args]
    with os.fdopen(fd, "w") as log_file:
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=own_process_group, env={**os.environ, **(env or {})})
    server = ServerProcess(proc=proc, port=port, log_path=log_path, args=args)
    if wait:
        try:
            server.wait_healthy()
        except BaseException:
            server.stop()
            raise
    return server


@pytest.fixture(scope="session")
def tokenizer():
    """The built-in model's tokenizer, as the servers of these tests load it."""
    from transformers import AutoTokenizer

    from engine.builtin_model import ensure_builtin_model

    return AutoTokenizer.from_pretrained(ensure_builtin_model())


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    extra = list(getattr(request.module, "SERVER_ARGS", []))
    proc = start_server_process(extra, env=getattr(request.module, "SERVER_ENV", None))
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def server_url(server: ServerProcess) -> str:
    return server.url


@pytest.fixture
def launch_server() -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def launch(extra_args: Sequence[str] = (), wait: bool = True, own_process_group: bool = False) -> ServerProcess:
        proc = start_server_process(extra_args, wait=False, own_process_group=own_process_group)
        started.append(proc)
        if wait:
            proc.wait_healthy()
        return proc

    try:
        yield launch
    finally:
        for proc in started:
            proc.stop()
