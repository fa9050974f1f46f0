"""PD disaggregation against one unified server, and the KV transfer path against a memory copy.

Part 1, serving (side by side, one run): the same workload through
  - unified: one server on cores 0-1, with 2 threads and again with 1 (a 2-thread OpenMP team
    suffers most from other processes on a shared machine; the PD servers have 1 thread each);
  - PD: a prefill server pinned to core 0 and a decode server pinned to core 1, behind
    sglang-router in --pd-disaggregation mode.
The workload has decode-heavy requests (short prompts, long outputs) that start together, and long
prompts that arrive one by one while they decode. Reported: TTFT of the long prompts, ITL
(p50/p99/max) of the decoding requests (what a long prefill disturbs), throughput.

Part 2, the transfer path (in this process, production code): a prefill and a decode transfer
manager with ZMQ over TCP on 127.0.0.1 move one request's KV (gather, CRC32, send, receive, CRC32,
scatter into the destination slots); the time from send() to Success gives GB/s, next to a plain
memory copy of the same bytes, for the built-in model's KV layout and an 8B-class layout (32 layers,
8 KV heads of 128, bfloat16), with what a 25 GB/s link would take for the same bytes.

  python benchmarks/bench_pd.py --output-file pd.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import httpx
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_router  # noqa: E402
import bench_serving  # noqa: E402
import pd_cluster  # noqa: E402
from serving_datasets import SampledRequest  # noqa: E402

LINK_GB_S = 25.0


# ---------------------------------------------------------------------------- part 1: serving
@dataclass
class Arrival:
    at_s: float
    kind: str  # "decode" (short prompt, long output) or "long" (long prompt, short output)
    request: SampledRequest


def build_workload(args: argparse.Namespace, vocab_size: int) -> List[Arrival]:
    rng = random.Random(args.seed)

    def ids(n: int) -> List[int]:
        return [rng.randrange(10, vocab_size) for _ in range(n)]

    work = [Arrival(0.0, "decode", SampledRequest(args.decode_input, args.decode_output, ids(args.decode_input)))
            for _ in range(args.decode_reqs)]
    for i in range(args.long_reqs):
        work.append(Arrival(args.long_start + i * args.long_interval, "long",
                            SampledRequest(args.long_input, args.long_output, ids(args.long_input))))
    return work


async def run_workload(base_url: str, work: Sequence[Arrival]) -> Tuple[List[bench_serving.RequestOutput], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        warm = await bench_serving.request_engine(client, base_url, SampledRequest(8, 4, [11] * 8), True, False)
        if not warm.success:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        start = time.perf_counter()

        async def one(arrival: Arrival) -> bench_serving.RequestOutput:
            await asyncio.sleep(max(0.0, start + arrival.at_s - time.perf_counter()))
            return await bench_serving.request_engine(client, base_url, arrival.request, True, False)

        outputs = await asyncio.gather(*(one(a) for a in work))
        return list(outputs), time.perf_counter() - start


def _stats_ms(values: Sequence[float]) -> Dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    arr = np.asarray(values) * 1e3
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99)),
            "max": float(arr.max())}


def summarize(work: Sequence[Arrival], outputs: Sequence[bench_serving.RequestOutput], duration: float
              ) -> Dict[str, Any]:
    failed = [o.error for o in outputs if not o.success]
    decode = [o for a, o in zip(work, outputs) if a.kind == "decode" and o.success]
    long = [o for a, o in zip(work, outputs) if a.kind == "long" and o.success]
    every = bench_serving.calculate_metrics(outputs, duration)
    return {
        "failed": len(failed), "errors": failed[:3], "duration_s": duration,
        "long_ttft_ms": _stats_ms([o.ttft for o in long]),
        "decode_itl_ms": _stats_ms([gap for o in decode for gap in o.itl]),
        "decode_ttft_ms": _stats_ms([o.ttft for o in decode]),
        "output_throughput": every.output_throughput, "total_throughput": every.total_throughput,
    }


def serve_unified(args: argparse.Namespace, work: List[Arrival], threads: int) -> Dict[str, Any]:
    server_args = f"{args.server_args} --threads-per-rank {threads}"
    with bench_serving.launched_server(server_args, cmd_prefix=["taskset", "-c", "0,1"]) as server:
        outputs, duration = asyncio.run(run_workload(server.base_url, work))
    return summarize(work, outputs, duration)


def serve_pd(args: argparse.Namespace, work: List[Arrival]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    bootstrap_port = bench_serving.find_free_port()
    prefill_args = f"{args.server_args} " + " ".join(pd_cluster.prefill_server_args(bootstrap_port))
    decode_args = f"{args.server_args} " + " ".join(pd_cluster.decode_server_args())
    with bench_serving.launched_server(prefill_args, cmd_prefix=["taskset", "-c", "0"]) as prefill, \
            bench_serving.launched_server(decode_args, cmd_prefix=["taskset", "-c", "1"]) as decode, \
            tempfile.TemporaryFile() as log:
        router, url = pd_cluster.start_pd_router([pd_cluster.PrefillEndpoint(prefill.base_url, bootstrap_port)],
                                                 [decode.base_url], "round_robin", log)
        try:
            bench_router.wait_router_ready(router, url, num_workers=2)
            outputs, duration = asyncio.run(run_workload(url, work))
            state = httpx.get(f"{decode.base_url}/get_server_info", timeout=30).json()["internal_states"][0]
        finally:
            bench_router.stop_process(router)
    pd = state["disaggregation"]["metrics"]
    latency = pd["histograms"]["kv_transfer_latency_ms"]
    transfers = latency["cumulative_counts"][-1]
    served = {
        "transferred_prompt_tokens": pd["num_transferred_prompt_tokens"],
        "decode_computed_tokens": state["num_extend_tokens_computed"],
        "transfers": transfers,
        "mean_kv_wait_ms": latency["sum"] / max(transfers, 1),  # destination published -> KV committed
        "kv_bytes": pd["kv_transferred_bytes"],
    }
    return summarize(work, outputs, duration), served


# ---------------------------------------------------------------------------- part 2: transfer path
@dataclass
class TransferResult:
    layout: str
    tokens: int
    bytes: int
    transfer_gb_s: float
    memcpy_gb_s: float
    gather_scatter_gb_s: float
    link_25gb_ms: float
    transfer_ms: float


def _pools(layers: int, heads: int, dim: int, dtype: torch.dtype, tokens: int):
    from engine.mem_cache.memory_pool import MHATokenToKVPool

    src = MHATokenToKVPool(tokens + 8, 1, dtype, heads, dim, layers)
    dst = MHATokenToKVPool(tokens + 8, 1, dtype, heads, dim, layers)
    for layer in src.k_buffer + src.v_buffer:
        layer.copy_(torch.randn(layer.shape).to(dtype))
    return src, dst


def measure_transfer(name: str, layers: int, heads: int, dim: int, dtype: torch.dtype, tokens: int,
                     repeats: int) -> TransferResult:
    from engine.disaggregation.base import KVPoll
    from engine.disaggregation.conn_common import KVArgs, TransferConfig
    from engine.disaggregation.conn_decode import DecodeKVManager, DecodeKVReceiver
    from engine.disaggregation.conn_prefill import PrefillKVManager, PrefillKVSender
    from engine.disaggregation.kv_io import KVLayout, gather_kv, scatter_kv
    from engine.disaggregation.loopback import LoopbackNetwork
    from engine.disaggregation.metadata import MetadataBuffers
    from engine.disaggregation.metrics import DisaggMetrics
    from engine.disaggregation.transport import ThreadJobRunner, ZmqTransport

    src, dst = _pools(layers, heads, dim, dtype, tokens)
    layout = KVLayout.of_pool(src, heads, 1, 0)
    registry = LoopbackNetwork().bootstrap_client()  # only the bootstrap table; the bytes go over TCP
    addr = "127.0.0.1:1"
    registry.serve(addr, 1, "bench")
    config = TransferConfig()
    prefill = PrefillKVManager(KVArgs(src, MetadataBuffers(4), layout, 1), ZmqTransport("127.0.0.1"),
                               ThreadJobRunner("bench-io-p"), registry, addr, config, DisaggMetrics())
    prefill.register()
    decode = DecodeKVManager(KVArgs(dst, MetadataBuffers(4), layout, 1), ZmqTransport("127.0.0.1"),
                             ThreadJobRunner("bench-io-d"), ThreadJobRunner("bench-ctl-d"), registry, config)
    src_slots = torch.randperm(tokens, dtype=torch.int64) + 1
    dst_slots = torch.randperm(tokens, dtype=torch.int64) + 1
    times = []
    try:
        for room in range(1, repeats + 2):
            receiver = DecodeKVReceiver(decode, room, addr)
            _wait(lambda: receiver.poll() == KVPoll.WaitingForInput)
            sender = PrefillKVSender(prefill, room)
            receiver.send_metadata(dst_slots, 0)
            _wait(lambda: sender.poll() == KVPoll.WaitingForInput)
            prefill.kv_args.metadata.rows["room"][0] = room
            start = time.perf_counter()
            sender.send(src_slots, prefill.kv_args.metadata.row_bytes(0))
            _wait(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed))
            elapsed = time.perf_counter() - start
            assert receiver.poll() == KVPoll.Success, receiver.failure()
            if room > 1:  # the first one pays for connecting
                times.append(elapsed)
            receiver.clear()
            sender.clear()
    finally:
        prefill.close()
        decode.close()
    for layer in range(layers):
        assert torch.equal(dst.k_buffer[layer][dst_slots], src.k_buffer[layer][src_slots]), "KV corrupted"
    nbytes = tokens * layout.bytes_per_token()
    flat = torch.empty(nbytes, dtype=torch.uint8)
    target = torch.empty_like(flat)
    memcpy = _best(lambda: target.copy_(flat), repeats)
    local = _best(lambda: scatter_kv(dst, dst_slots, gather_kv(src, src_slots)), repeats)
    best = min(times)
    return TransferResult(name, tokens, nbytes, nbytes / best / 1e9, nbytes / memcpy / 1e9, nbytes / local / 1e9,
                          nbytes / (LINK_GB_S * 1e9) * 1e3, best * 1e3)


def _wait(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the transfer did not finish")
        time.sleep(0.0002)


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


# ---------------------------------------------------------------------------- report
def report(results: Dict[str, Any]) -> str:
    lines = ["", "Serving on cores 0-1: unified (2 threads; 1 thread) vs PD (prefill on core 0, decode on core 1, "
                 "1 thread each) through sglang-router"]
    configs = ("unified", "unified_1t", "pd")
    lines.append(f"{'':28s}{'unified 2t':>14s}{'unified 1t':>14s}{'PD':>14s}")
    rows = [("long-prompt TTFT mean (ms)", "long_ttft_ms", "mean"), ("long-prompt TTFT p99 (ms)", "long_ttft_ms", "p99"),
            ("decode ITL p50 (ms)", "decode_itl_ms", "p50"), ("decode ITL p99 (ms)", "decode_itl_ms", "p99"),
            ("decode ITL max (ms)", "decode_itl_ms", "max"), ("decode TTFT mean (ms)", "decode_ttft_ms", "mean")]
    for label, key, stat in rows:
        lines.append(f"{label:28s}" + "".join(f"{results[c][key][stat]:14.1f}" for c in configs))
    for label, key in (("output throughput (tok/s)", "output_throughput"), ("total throughput (tok/s)",
                                                                            "total_throughput"),
                       ("failed requests", "failed")):
        lines.append(f"{label:28s}" + "".join(f"{results[c][key]:14.1f}" for c in configs))
    served = results["pd_served"]
    lines.append(f"PD decode server: {served['transferred_prompt_tokens']} prompt tokens by transfer, "
                 f"{served['decode_computed_tokens']} computed; mean wait for KV after reserving memory "
                 f"{served['mean_kv_wait_ms']:.1f} ms (includes the prefill's compute)")
    lines += ["", "KV transfer path (gather + CRC32 + ZMQ/TCP on 127.0.0.1 + CRC32 + scatter) vs memory copy",
              f"{'layout':26s}{'tokens':>8s}{'MB':>9s}{'path ms':>9s}{'path GB/s':>11s}{'memcpy GB/s':>13s}"
              f"{'gather+scatter':>16s}{'25 GB/s link ms':>17s}"]
    for t in results["transfer"]:
        lines.append(f"{t['layout']:26s}{t['tokens']:8d}{t['bytes'] / 1e6:9.1f}{t['transfer_ms']:9.2f}"
                     f"{t['transfer_gb_s']:11.2f}{t['memcpy_gb_s']:13.2f}{t['gather_scatter_gb_s']:16.2f}"
                     f"{t['link_25gb_ms']:17.2f}")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server-args", default="--device cpu --max-total-tokens 32768 --log-level warning")
    p.add_argument("--decode-reqs", type=int, default=8)
    p.add_argument("--decode-input", type=int, default=64)
    p.add_argument("--decode-output", type=int, default=160)
    p.add_argument("--long-reqs", type=int, default=6)
    p.add_argument("--long-input", type=int, default=1800)
    p.add_argument("--long-output", type=int, default=8)
    p.add_argument("--long-start", type=float, default=0.5)
    p.add_argument("--long-interval", type=float, default=0.7)
    p.add_argument("--transfer-tokens", type=int, default=1800)
    p.add_argument("--transfer-repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-serving", action="store_true", help="only the transfer path")
    p.add_argument("--output-file")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    results: Dict[str, Any] = {"args": vars(args)}
    if not args.skip_serving:
        from engine.builtin_model import SPEC

        work = build_workload(args, SPEC.vocab_size)
        results["unified"] = serve_unified(args, work, threads=2)
        # One OpenMP thread, as each PD server has: on a shared machine a 2-thread team loses far
        # more to other processes than two 1-thread processes do (docs/architecture.md).
        results["unified_1t"] = serve_unified(args, work, threads=1)
        results["pd"], results["pd_served"] = serve_pd(args, work)
    results["transfer"] = [
        asdict(measure_transfer("built-in (4x4x32 fp32)", 4, 4, 32, torch.float32, args.transfer_tokens,
                                args.transfer_repeats)),
        asdict(measure_transfer("8B-class (32x8x128 bf16)", 32, 8, 128, torch.bfloat16,
                                min(args.transfer_tokens, 1024), args.transfer_repeats)),
    ]
    if not args.skip_serving:
        print(report(results))
    else:
        for t in results["transfer"]:
            print(t)
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
