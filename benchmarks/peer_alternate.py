"""One request at a time against two running servers, alternated, the idle one stopped: a ratio that survives
this kind of machine's drifting speed.

`peer_llamacpp.py` measures each system in its own window of time; on a shared 2-core VM the speed moves by up to
2x within minutes, so a one-request ratio of two such windows can swing by tens of percent. Here both servers run
at once (started by the caller on --a-url and --b-url), and requests go to them in blocks of --per-block (each
block's order reversed every other time), the other server's processes stopped with SIGSTOP meanwhile (its idle
threads would otherwise compete for the cores) and resumed after. Each request is bench_peers' random 128-token
prompt (token ids), --max-tokens greedy tokens, EOS ignored, non-streaming /v1/completions; both servers must
accept the model name --model. The table gives each server's median and mean tokens per second per request
(output tokens over the request's wall time, prefill included) and B / A.

  python benchmarks/peer_alternate.py --a-url http://127.0.0.1:30001 --b-url http://127.0.0.1:30002 --blocks 12
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from typing import Dict, List

import httpx
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peer_workloads import random_batch  # noqa: E402


def server_processes(url: str) -> List[psutil.Process]:
    """The process listening on url's port and every process of its session (a server's workers)."""
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            sid = os.getsid(conn.pid)
            return [p for p in psutil.process_iter() if _sid(p.pid) == sid]
    raise SystemExit(f"nothing listens on {url}")


def _sid(pid: int) -> int:
    try:
        return os.getsid(pid)
    except OSError:
        return -1


def _signal(procs: List[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a-url", required=True)
    ap.add_argument("--b-url", required=True)
    ap.add_argument("--model", default="default")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--per-block", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    urls = {"A": args.a_url, "B": args.b_url}
    procs = {name: server_processes(url) for name, url in urls.items()}
    prompts = random_batch(16).prompts
    client = httpx.Client(timeout=120)

    def one(url: str, prompt: List[int]) -> float:
        body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True}
        start = time.perf_counter()
        client.post(url + "/v1/completions", json=body).raise_for_status()
        return time.perf_counter() - start

    for url in urls.values():  # warm-up
        one(url, prompts[0])
    times: Dict[str, List[float]] = {"A": [], "B": []}
    for block in range(args.blocks):
        for name in ("A", "B") if block % 2 == 0 else ("B", "A"):
            other = "B" if name == "A" else "A"
            _signal(procs[other], signal.SIGSTOP)
            try:
                for i in range(args.per_block):
                    times[name].append(one(urls[name], prompts[(block * args.per_block + i) % len(prompts)]))
            finally:
                _signal(procs[other], signal.SIGCONT)
    for name, t in times.items():
        print(f"{name} {urls[name]}: tok/s per request median {args.max_tokens / statistics.median(t):.1f}, "
              f"mean {args.max_tokens * len(t) / sum(t):.1f} ({len(t)} requests)")
    print(f"B / A: median {statistics.median(times['A']) / statistics.median(times['B']):.3f}, "
          f"mean {sum(times['A']) / sum(times['B']):.3f}")


if __name__ == "__main__":
    main()
