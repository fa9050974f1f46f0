"""Start PD deployments for tests and benchmarks: prefill and decode servers behind sglang-router.

`start_pd_router` runs `python -m sglang_router.launch_router --pd-disaggregation --prefill URL
BOOTSTRAP_PORT ... --decode URL ... --policy P` on free ports of 127.0.0.1 (wait for it and stop
it with bench_router's `wait_router_ready` and `stop_process`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import find_free_port  # noqa: E402


@dataclass(frozen=True)
class PrefillEndpoint:
    url: str
    # None: `--prefill URL` alone; the router then sends `"bootstrap_port": null` and the servers take
    # their own --disaggregation-bootstrap-port (SGLang's own PD example is written that way).
    bootstrap_port: Optional[int]


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
        cmd += ["--prefill", prefill.url]
        if prefill.bootstrap_port is not None:
            cmd.append(str(prefill.bootstrap_port))
    for decode in decodes:
        cmd += ["--decode", decode]
    cmd += list(extra_args)
    return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"
