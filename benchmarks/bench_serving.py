"""Online serving benchmark over HTTP, after SGLang's bench_serving, with its metric set.

Sends a workload to a running server (or one it launches with --launch-server) with Poisson
arrivals (--request-rate, inf = all at once) under an optional concurrency cap, streams every
response, and reports request / input / output / total token throughput, achieved concurrency,
TTFT, ITL, TPOT and end-to-end latency (mean, median, p99).

Backends:
  engine  native `POST /generate` with input_ids (or text), SSE with cumulative output_ids.
  openai  `POST /v1/completions` on any OpenAI-compatible server, prompts as token-id lists or
          text; output tokens are counted from the streamed `usage`.

Examples:
  python benchmarks/bench_serving.py --launch-server --dataset random --num-prompts 64 \
      --random-input-len 512 --random-output-len 256 --random-range-ratio 0.0625
  python benchmarks/bench_serving.py --backend openai --base-url http://127.0.0.1:8000 \
      --model my-model --tokenizer /path/to/model --dataset sharegpt --num-prompts 200 --request-rate 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import httpx
import numpy as np
import orjson

logger = logging.getLogger(__name__)


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serving_datasets as bench_datasets  # noqa: E402

SampledRequest = bench_datasets.SampledRequest

SSE_DATA_PREFIX = b"data:"
SSE_DONE = b"[DONE]"


# ---------------------------------------------------------------------------- per-request records
@dataclass
class RequestOutput:
    """What one streamed request measured (times in seconds, relative to its own send time)."""

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: List[float] = field(default_factory=list)
    error: str = ""
    start_time: float = 0.0
    generated_text: str = ""

    @property
    def tpot(self) -> Optional[float]:
        """SGLang's TPOT: decode time over the tokens after the first; None for one-token outputs."""
        if self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


class TokenTimer:
    """Turns the arrival times of streamed chunks into TTFT and per-token ITL.

    A chunk that carries k new tokens after a gap g adds k ITL entries of g / k: the tokens were
    produced over that gap, the server only batched them into one chunk.
    """

    def __init__(self, start: float) -> None:
        self.start = start
        self.ttft: Optional[float] = None
        self.last: float = start
        self.itl: List[float] = []

    def on_tokens(self, now: float, num_new_tokens: int) -> None:
        if num_new_tokens <= 0:
            return
        if self.ttft is None:
            self.ttft = now - self.start
            # The first chunk may already hold several tokens; those after the first arrived
            # with it, so they add zero-gap ITL entries and the counts stay consistent.
            self.itl.extend([0.0] * (num_new_tokens - 1))
        else:
            gap = (now - self.last) / num_new_tokens
            self.itl.extend([gap] * num_new_tokens)
        self.last = now


def split_sse_events(buffer: bytes) -> Tuple[List[bytes], bytes]:
    """Complete SSE `data:` payloads in buffer, and the incomplete rest to keep for the next read."""
    buffer = buffer.replace(b"\r\n", b"\n")
    *events, rest = buffer.split(b"\n\n")
    payloads = []
    for event in events:
        data_lines = [line[len(SSE_DATA_PREFIX):].lstrip(b" ") for line in event.split(b"\n")
                      if line.startswith(SSE_DATA_PREFIX)]
        if data_lines:
            payloads.append(b"\n".join(data_lines))
    return payloads, rest


async def iter_sse(response: httpx.Response) -> Any:
    """Yield (arrival time, payload bytes) for each SSE event of a streamed response."""
    buffer = b""
    async for chunk in response.aiter_bytes():
        now = time.perf_counter()
        buffer += chunk
        payloads, buffer = split_sse_events(buffer)
        for payload in payloads:
            yield now, payload
    if buffer.strip():
        payloads, _ = split_sse_events(buffer + b"\n\n")
        for payload in payloads:
            yield time.perf_counter(), payload


def _error_message(data: Dict[str, Any]) -> Optional[str]:
    if "error" in data:
        err = data["error"]
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    if data.get("object") == "error":
        return str(data.get("message", data))
    return None


# ---------------------------------------------------------------------------- backends
def engine_payload(req: SampledRequest, ignore_eos: bool, use_text: bool) -> Dict[str, Any]:
    payload: Dict[str, Any] = {
        "sampling_params": {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": ignore_eos},
        "stream": True,
    }
    if req.prompt_ids is not None and not use_text:
        payload["input_ids"] = req.prompt_ids
    else:
        payload["text"] = req.prompt_text
    return payload


def openai_payload(req: SampledRequest, model: str, ignore_eos: bool, use_text: bool) -> Dict[str, Any]:
    prompt: Any = req.prompt_ids if req.prompt_ids is not None and not use_text else req.prompt_text
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _post_stream(client: httpx.AsyncClient, url: str, payload: Dict[str, Any], out: RequestOutput,
                       timer: TokenTimer, on_event: Any) -> None:
    body = orjson.dumps(payload)
    start = time.perf_counter()
    out.start_time = timer.start = timer.last = start
    async with client.stream("POST", url, content=body, headers={"Content-Type": "application/json"}) as resp:
        if resp.status_code != 200:
            out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:500]}"
            return
        async for now, payload_bytes in iter_sse(resp):
            if payload_bytes == SSE_DONE:
                break
            data = orjson.loads(payload_bytes)
            message = _error_message(data)
            if message is not None:
                out.error = message
                return
            on_event(now, data)
    out.latency = time.perf_counter() - start


async def request_engine(client: httpx.AsyncClient, base_url: str, req: SampledRequest, ignore_eos: bool,
                         use_text: bool) -> RequestOutput:
    """Native /generate: each event carries cumulative output_ids and meta_info counts."""
    out = RequestOutput(prompt_len=req.prompt_len)
    timer = TokenTimer(time.perf_counter())
    seen = 0

    def on_event(now: float, data: Dict[str, Any]) -> None:
        nonlocal seen
        meta = data.get("meta_info", {})
        count = meta.get("completion_tokens")
        if count is None:
            count = len(data.get("output_ids") or [])
        timer.on_tokens(now, count - seen)
        seen = max(seen, count)
        out.prompt_len = meta.get("prompt_tokens", out.prompt_len)
        out.generated_text = data.get("text", out.generated_text)

    try:
        await _post_stream(client, base_url + "/generate", engine_payload(req, ignore_eos, use_text), out, timer,
                           on_event)
        _finish(out, timer, seen)
    except Exception as exc:  # a benchmark records failures, it does not stop on them
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def request_openai(client: httpx.AsyncClient, base_url: str, req: SampledRequest, model: str,
                         ignore_eos: bool, use_text: bool) -> RequestOutput:
    """/v1/completions: a chunk's token count is unknown, so each text chunk counts as one step."""
    out = RequestOutput(prompt_len=req.prompt_len)
    timer = TokenTimer(time.perf_counter())
    chunks_with_text = 0
    usage_tokens: Optional[int] = None
    texts: List[str] = []

    def on_event(now: float, data: Dict[str, Any]) -> None:
        nonlocal chunks_with_text, usage_tokens
        for choice in data.get("choices") or []:
            text = choice.get("text") or ""
            if text:
                texts.append(text)
                chunks_with_text += 1
                timer.on_tokens(now, 1)
        usage = data.get("usage")
        if usage:
            usage_tokens = usage.get("completion_tokens", usage_tokens)
            out.prompt_len = usage.get("prompt_tokens", out.prompt_len)

    try:
        await _post_stream(client, base_url + "/v1/completions",
                           openai_payload(req, model, ignore_eos, use_text), out, timer, on_event)
        out.generated_text = "".join(texts)
        _finish(out, timer, usage_tokens if usage_tokens is not None else chunks_with_text)
    except Exception as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


def _finish(out: RequestOutput, timer: TokenTimer, output_len: int) -> None:
    if out.error:
        return
    if timer.ttft is None:
        out.error = "the stream ended without any token"
        return
    out.success = True
    out.output_len = output_len
    out.ttft = timer.ttft
    out.itl = timer.itl


# ---------------------------------------------------------------------------- metrics
@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input: int
    total_output: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    concurrency: float
    mean_ttft_ms: float
    median_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    p95_itl_ms: float
    p99_itl_ms: float
    max_itl_ms: float
    mean_e2e_latency_ms: float
    median_e2e_latency_ms: float
    p99_e2e_latency_ms: float


def _ms_stats(values: Sequence[float], percentiles: Sequence[int] = (99,)) -> Dict[str, float]:
    if not values:
        return {"mean": math.nan, "median": math.nan, "max": math.nan, **{f"p{p}": math.nan for p in percentiles}}
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    stats = {"mean": float(arr.mean()), "median": float(np.median(arr)), "max": float(arr.max())}
    for p in percentiles:
        stats[f"p{p}"] = float(np.percentile(arr, p))
    return stats


def calculate_metrics(outputs: Sequence[RequestOutput], duration_s: float) -> BenchmarkMetrics:
    """SGLang's metrics over the successful requests; duration is the whole benchmark's wall time."""
    ok = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(o.output_len for o in ok)
    ttft = _ms_stats([o.ttft for o in ok])
    tpot = _ms_stats([o.tpot for o in ok if o.tpot is not None])
    itl = _ms_stats([gap for o in ok for gap in o.itl], percentiles=(95, 99))
    e2e = _ms_stats([o.latency for o in ok])
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(outputs) - len(ok),
        duration_s=duration_s,
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(ok) / duration_s,
        input_throughput=total_input / duration_s,
        output_throughput=total_output / duration_s,
        total_throughput=(total_input + total_output) / duration_s,
        # Little's law: the mean number of requests in flight over the run.
        concurrency=sum(o.latency for o in ok) / duration_s,
        mean_ttft_ms=ttft["mean"], median_ttft_ms=ttft["median"], p99_ttft_ms=ttft["p99"],
        mean_tpot_ms=tpot["mean"], median_tpot_ms=tpot["median"], p99_tpot_ms=tpot["p99"],
        mean_itl_ms=itl["mean"], median_itl_ms=itl["median"], p95_itl_ms=itl["p95"], p99_itl_ms=itl["p99"],
        max_itl_ms=itl["max"],
        mean_e2e_latency_ms=e2e["mean"], median_e2e_latency_ms=e2e["median"], p99_e2e_latency_ms=e2e["p99"],
    )


def format_result_table(m: BenchmarkMetrics, backend: str, request_rate: float,
                        max_concurrency: Optional[int]) -> str:
    """The table SGLang's bench_serving prints."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(name: str, value: Any, fmt: str = "") -> None:
        text = format(value, fmt) if fmt else str(value)
        lines.append("{:<40} {:<10}".format(name, text))

    def section(title: str) -> None:
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))

    row("Backend:", backend)
    row("Traffic request rate:", request_rate)
    row("Max request concurrency:", max_concurrency if max_concurrency else "not set")
    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Benchmark duration (s):", m.duration_s, ".2f")
    row("Total input tokens:", m.total_input)
    row("Total generated tokens:", m.total_output)
    row("Request throughput (req/s):", m.request_throughput, ".2f")
    row("Input token throughput (tok/s):", m.input_throughput, ".2f")
    row("Output token throughput (tok/s):", m.output_throughput, ".2f")
    row("Total token throughput (tok/s):", m.total_throughput, ".2f")
    row("Concurrency:", m.concurrency, ".2f")
    section("End-to-End Latency")
    row("Mean E2E Latency (ms):", m.mean_e2e_latency_ms, ".2f")
    row("Median E2E Latency (ms):", m.median_e2e_latency_ms, ".2f")
    row("P99 E2E Latency (ms):", m.p99_e2e_latency_ms, ".2f")
    section("Time to First Token")
    row("Mean TTFT (ms):", m.mean_ttft_ms, ".2f")
    row("Median TTFT (ms):", m.median_ttft_ms, ".2f")
    row("P99 TTFT (ms):", m.p99_ttft_ms, ".2f")
    section("Time per Output Token (excl. 1st token)")
    row("Mean TPOT (ms):", m.mean_tpot_ms, ".2f")
    row("Median TPOT (ms):", m.median_tpot_ms, ".2f")
    row("P99 TPOT (ms):", m.p99_tpot_ms, ".2f")
    section("Inter-Token Latency")
    row("Mean ITL (ms):", m.mean_itl_ms, ".2f")
    row("Median ITL (ms):", m.median_itl_ms, ".2f")
    row("P95 ITL (ms):", m.p95_itl_ms, ".2f")
    row("P99 ITL (ms):", m.p99_itl_ms, ".2f")
    row("Max ITL (ms):", m.max_itl_ms, ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


def format_cpu_table(cpu: CpuUsage, total_output_tokens: int) -> str:
    """CPU seconds per process in the measured window; on a small CPU box they compete for cores."""
    lines = ["{s:{c}^{n}}".format(s="CPU time in the measured window", n=50, c="-")]
    for name, seconds in sorted(cpu.by_process.items(), key=lambda kv: -kv[1]):
        if seconds < 0.005:  # idle helpers (multiprocessing's resource tracker) are noise here
            continue
        lines.append("{:<40} {:<10}".format(f"{name} (s):", f"{seconds:.2f}"))
    lines.append("{:<40} {:<10}".format("Total CPU (s):", f"{cpu.total:.2f}"))
    if cpu.total > 0:
        lines.append("{:<40} {:<10}".format("Output tokens per CPU second:", f"{total_output_tokens / cpu.total:.2f}"))
    lines.append("=" * 50)
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the run
@dataclass
class BenchConfig:
    backend: str
    base_url: str
    model: str
    request_rate: float
    max_concurrency: Optional[int]
    ignore_eos: bool
    use_text: bool
    seed: int
    warmup_requests: int = 1
    show_progress: bool = True
    server_pid: Optional[int] = None


@dataclass
class CpuUsage:
    """CPU seconds spent during the measured window, by process: where the serving cost goes."""

    by_process: Dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.by_process.values())


def process_tree_cpu(pid: int) -> Dict[str, float]:
    """User + system CPU seconds of a process and its descendants, keyed by process title."""
    import psutil

    root = psutil.Process(pid)
    usage: Dict[str, float] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            cmdline = proc.cmdline()
        except psutil.Error:  # exited between listing and reading
            continue
        # Our processes set their title (engine::scheduler_TP0, ...); others show their command.
        title = cmdline[0] if cmdline and cmdline[0].startswith("engine::") else f"{proc.name()}[{proc.pid}]"
        if title == "engine::main" and proc.pid != pid:
            title = f"{title}[{proc.pid}]"
        usage[title] = usage.get(title, 0.0) + times.user + times.system
    return usage


def cpu_delta(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}


async def _send(client: httpx.AsyncClient, cfg: BenchConfig, req: SampledRequest) -> RequestOutput:
    if cfg.backend == "engine":
        return await request_engine(client, cfg.base_url, req, cfg.ignore_eos, cfg.use_text)
    return await request_openai(client, cfg.base_url, req, cfg.model, cfg.ignore_eos, cfg.use_text)


async def run_benchmark(cfg: BenchConfig, requests: Sequence[SampledRequest],
                        ) -> Tuple[List[RequestOutput], float, Optional[CpuUsage]]:
    """Send all requests (Poisson arrivals, optional concurrency cap).

    Returns the outputs in request order, the wall time, and (with cfg.server_pid) the CPU seconds
    that the server's processes and this client spent in the measured window.
    """
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        for _ in range(cfg.warmup_requests):
            # One short request first, as SGLang does: it fails fast on a wrong URL or model and
            # keeps first-call costs out of the measurement.
            warm = SampledRequest(prompt_len=requests[0].prompt_len, output_len=min(4, requests[0].output_len),
                                  prompt_ids=requests[0].prompt_ids, prompt_text=requests[0].prompt_text)
            result = await _send(client, cfg, warm)
            if not result.success:
                raise RuntimeError(f"warm-up request failed: {result.error}")

        semaphore = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        progress = _progress_bar(len(requests), cfg.show_progress)

        async def limited(req: SampledRequest) -> RequestOutput:
            if semaphore is None:
                result = await _send(client, cfg, req)
            else:
                async with semaphore:
                    result = await _send(client, cfg, req)
            if progress is not None:
                progress.update(1)
            return result

        server_cpu_before = process_tree_cpu(cfg.server_pid) if cfg.server_pid else None
        client_cpu_before = time.process_time()
        start = time.perf_counter()
        tasks = []
        for req, gap in zip(requests, bench_datasets.poisson_intervals(len(requests), cfg.request_rate, cfg.seed)):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(req)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        cpu = None
        if server_cpu_before is not None:
            cpu = CpuUsage(cpu_delta(server_cpu_before, process_tree_cpu(cfg.server_pid)))
            cpu.by_process["bench client"] = time.process_time() - client_cpu_before
        if progress is not None:
            progress.close()
    return list(outputs), duration, cpu


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total)


# ---------------------------------------------------------------------------- server and dataset set-up
def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_health(base_url: str, proc: Optional[subprocess.Popen], timeout_s: float) -> None:
    """Poll /health until it answers 200; fail early if the server process exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was healthy")
        try:
            if httpx.get(base_url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server at {base_url} was not healthy within {timeout_s:.0f}s")


@dataclass
class LaunchedServer:
    base_url: str
    pid: int


@contextmanager
def launched_server(server_args: str, host: str = "127.0.0.1", timeout_s: float = 600.0,
                    log_file: Optional[str] = None, cmd_prefix: Sequence[str] = ()) -> Iterator[LaunchedServer]:
    """Start `python -m engine.launch_server` on a free port; yield its URL and pid; always stop it.

    `cmd_prefix` runs the server under another command (`taskset -c 0` pins it to a core)."""
    port = find_free_port(host)
    cmd = [*cmd_prefix, sys.executable, "-m", "engine.launch_server", "--host", host, "--port", str(port),
           *shlex.split(server_args)]
    logger.info("Launching: %s", " ".join(shlex.quote(c) for c in cmd))
    # The server's log goes to a file, not our stdout (it would break up the table); a temporary
    # one unless asked, so that a failed start can still show why.
    log = open(log_file, "w+b") if log_file else tempfile.TemporaryFile()
    # A session of its own, so a stuck server can be killed with everything it spawned.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base_url = f"http://{host}:{port}"
        try:
            wait_for_health(base_url, proc, timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            raise LaunchFailed(f"{exc}; the server's last output:\n{_tail(log)}") from None
        yield LaunchedServer(base_url, proc.pid)
    finally:
        _stop_server(proc)
        log.close()


class LaunchFailed(RuntimeError):
    pass


def _tail(log: Any, max_lines: int = 20) -> str:
    log.flush()
    log.seek(0)
    return "\n".join(log.read().decode(errors="replace").splitlines()[-max_lines:])


def _stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # the server stops its own children on SIGTERM
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            logger.warning("The server did not stop within 30s; killing its process group.")
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of its process group
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def server_model_info(base_url: str) -> Dict[str, Any]:
    try:
        resp = httpx.get(base_url + "/get_model_info", timeout=10.0)
        return resp.json() if resp.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def build_requests(args: argparse.Namespace, tokenizer: Any, vocab_size: Optional[int]) -> List[SampledRequest]:
    if args.dataset in ("random", "generated-shared-prefix") and vocab_size is None:
        raise SystemExit("error: the vocabulary size is unknown: pass --tokenizer or --random-vocab-size")
    if args.dataset == "random":
        reqs = bench_datasets.sample_random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                                                     args.random_range_ratio, vocab_size, args.seed)
    elif args.dataset == "generated-shared-prefix":
        reqs = bench_datasets.sample_generated_shared_prefix_requests(
            args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len, args.gsp_question_len,
            args.gsp_output_len, vocab_size, args.seed)
    else:
        reqs = bench_datasets.sample_synthetic_sharegpt_requests(
            args.num_prompts, args.seed, tokenizer=tokenizer, fixed_output_len=args.sharegpt_output_len,
            max_total_len=args.sharegpt_context_len)
    if args.prompt_as_text:
        if tokenizer is None:
            raise SystemExit("error: --prompt-as-text needs a tokenizer (--tokenizer)")
        for r in reqs:
            if r.prompt_text is None:
                r.prompt_text = tokenizer.decode(r.prompt_ids)
    return reqs


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["engine", "openai"], default="engine")
    ap.add_argument("--base-url", default=None, help="default http://127.0.0.1:30000")
    ap.add_argument("--model", default=None, help="model name for the openai backend (default: the server's)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer path (text datasets, vocab size, --prompt-as-text)")
    ap.add_argument("--dataset", choices=["random", "generated-shared-prefix", "sharegpt"], default="sharegpt")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="req/s, Poisson arrivals; inf = at once")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--disable-ignore-eos", action="store_true")
    ap.add_argument("--prompt-as-text", action="store_true", help="send token-id datasets as decoded text")
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-output-len", type=int, default=1024)
    ap.add_argument("--random-range-ratio", type=float, default=0.0)
    ap.add_argument("--random-vocab-size", type=int, default=None,
                    help="default: the tokenizer's, else the server's /get_model_info")
    ap.add_argument("--gsp-num-groups", type=int, default=64)
    ap.add_argument("--gsp-prompts-per-group", type=int, default=16)
    ap.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    ap.add_argument("--gsp-question-len", type=int, default=128)
    ap.add_argument("--gsp-output-len", type=int, default=256)
    ap.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed output length for sharegpt")
    ap.add_argument("--sharegpt-context-len", type=int, default=bench_datasets.SHAREGPT_MAX_TOTAL_LEN,
                    help="drop conversations whose prompt + output exceed this")
    ap.add_argument("--warmup-requests", type=int, default=1)
    ap.add_argument("--output-file", default=None, help="JSON with the metrics and per-request records")
    ap.add_argument("--disable-tqdm", action="store_true")
    ap.add_argument("--launch-server", action="store_true", help="start python -m engine.launch_server first")
    ap.add_argument("--server-args", default="", help="extra flags for the launched server, one string")
    ap.add_argument("--server-log", default=None, help="file for the launched server's output")
    ap.add_argument("--server-timeout", type=float, default=600.0)
    ap.add_argument("--server-pid", type=int, default=None,
                    help="pid of a local server's main process: report CPU seconds per process")
    args = ap.parse_args(argv)
    if args.launch_server and args.base_url:
        ap.error("--launch-server picks its own port; do not pass --base-url with it")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        ap.error("--max-concurrency must be >= 1")
    if args.request_rate <= 0:
        ap.error("--request-rate must be > 0 (inf for all at once)")
    return args


def run(args: argparse.Namespace, base_url: str, server_pid: Optional[int] = None) -> Dict[str, Any]:
    wait_for_health(base_url, None, 30.0)
    info = server_model_info(base_url) if args.backend == "engine" or args.model is None else {}
    tokenizer_path = args.tokenizer or (info.get("tokenizer_path") if args.dataset == "sharegpt" else None)
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None
    vocab_size = args.random_vocab_size or (len(tokenizer) if tokenizer is not None else info.get("vocab_size"))
    model = args.model or info.get("served_model_name") or _first_model(base_url)
    requests = build_requests(args, tokenizer, vocab_size)
    if not requests:
        raise SystemExit("error: the dataset is empty")
    cfg = BenchConfig(backend=args.backend, base_url=base_url, model=model, request_rate=args.request_rate,
                      max_concurrency=args.max_concurrency, ignore_eos=not args.disable_ignore_eos,
                      use_text=args.prompt_as_text, seed=args.seed, warmup_requests=args.warmup_requests,
                      show_progress=not args.disable_tqdm, server_pid=server_pid)
    outputs, duration, cpu = asyncio.run(run_benchmark(cfg, requests))
    metrics = calculate_metrics(outputs, duration)
    print(format_result_table(metrics, args.backend, args.request_rate, args.max_concurrency))
    if cpu is not None:
        print(format_cpu_table(cpu, metrics.total_output))
    for o in outputs:
        if not o.success:
            logger.warning("A request failed: %s", o.error)
            break
    result = {
        "args": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()},
        "base_url": base_url,
        "model": model,
        "metrics": asdict(metrics),
        "cpu_seconds": cpu.by_process if cpu is not None else None,
        "requests": [dict(asdict(o), tpot=o.tpot) for o in outputs],
    }
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(json_safe(result), f, indent=1, allow_nan=False)
    return result


def json_safe(value: Any) -> Any:
    """NaN / inf (metrics of an empty set, an infinite rate) as null: strict JSON readers reject them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _first_model(base_url: str) -> str:
    try:
        return httpx.get(base_url + "/v1/models", timeout=10.0).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return "default"


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the table
    args = parse_args(argv)
    if args.launch_server:
        try:
            with launched_server(args.server_args, timeout_s=args.server_timeout,
                                 log_file=args.server_log) as server:
                return run(args, server.base_url, server.pid)
        except LaunchFailed as exc:
            sys.exit(f"error: {exc}")
    return run(args, args.base_url or "http://127.0.0.1:30000", args.server_pid)


if __name__ == "__main__":
    main()
