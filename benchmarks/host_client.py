"""A lean HTTP load generator for bench_host: many concurrent /generate requests on raw sockets.

With 1024 concurrent streams the server sends ~10^5 SSE events per second; a full HTTP client
(httpx) spends more CPU per event than the server does and would be what is measured. This one
writes the request by hand, reads until the server closes the connection, and per read only
looks for the newest `"completion_tokens":N` of the stream: the arrival time of each count is all
the steady-state window needs. The last event (or the JSON body) is parsed in full at the end to
check the result.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import orjson

_COUNT = re.compile(rb'"completion_tokens":(\d+)[,}]')
_TAIL_KEEP = 64  # bytes kept between reads so a count split across two reads is still found


@dataclass
class StreamRecord:
    sent: float = 0.0
    first: Optional[float] = None
    end: float = 0.0
    samples: List[Tuple[float, int]] = field(default_factory=list)  # (arrival time, completion tokens)
    completion_tokens: int = 0
    error: str = ""


async def _request(host: str, port: int, body: bytes, stream: bool) -> StreamRecord:
    rec = StreamRecord(sent=time.perf_counter())
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as e:
        rec.error = f"connect: {e}"
        return rec
    writer.write(b"POST /generate HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (host.encode(), len(body)) + body)
    tail = b""
    chunks: List[bytes] = []
    try:
        while True:
            data = await reader.read(1 << 16)
            if not data:
                break
            now = time.perf_counter()
            chunks.append(data)
            if stream:
                counts = _COUNT.findall(tail + data)
                if counts:
                    n = int(counts[-1])
                    if rec.first is None:
                        rec.first = now
                    rec.samples.append((now, n))
                tail = (tail + data)[-_TAIL_KEEP:]
    finally:
        writer.close()
    rec.end = time.perf_counter()
    _check(rec, b"".join(chunks), stream)
    return rec


def _check(rec: StreamRecord, raw: bytes, stream: bool) -> None:
    head, _, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        rec.error = head.split(b"\r\n", 1)[0].decode(errors="replace") + " " + body[:300].decode(errors="replace")
        return
    if stream:
        if b"data: [DONE]" not in body:
            rec.error = "the stream ended without [DONE]"
        rec.completion_tokens = rec.samples[-1][1] if rec.samples else 0
        return
    # Non-streaming: a Content-Length body (no chunked framing to undo).
    out = orjson.loads(body)
    rec.completion_tokens = int(out["meta_info"]["completion_tokens"])
    rec.first = rec.end
    rec.samples.append((rec.end, rec.completion_tokens))


async def run_clients(host: str, port: int, prompts: Sequence[List[int]], output_len: int,
                      stream: bool) -> Tuple[List[StreamRecord], float, float]:
    """Send every prompt at once on its own connection; (records, start time, wall seconds)."""
    bodies = [orjson.dumps({"input_ids": p, "stream": stream,
                            "sampling_params": {"max_new_tokens": output_len, "ignore_eos": True,
                                                "temperature": 0.0}}) for p in prompts]
    start = time.perf_counter()
    records = await asyncio.gather(*(_request(host, port, b, stream) for b in bodies))
    return list(records), start, time.perf_counter() - start


def steady_window(records: Sequence[StreamRecord], min_window_s: float) -> Optional[Tuple[float, float, int]]:
    """(t0, t1, tokens): from the moment every stream has its first token to the first stream's
    last token, the tokens all streams received in between. None when there is no such window
    of at least `min_window_s`: counts arrive in chunks, so a short window is mostly error."""
    if not records or any(r.first is None or not r.samples for r in records):
        return None
    t0 = max(r.first for r in records)
    t1 = min(r.samples[-1][0] for r in records)
    if t1 - t0 < min_window_s:
        return None
    tokens = sum(_count_at(r, t1) - _count_at(r, t0) for r in records)
    return t0, t1, tokens


def _count_at(rec: StreamRecord, t: float) -> int:
    n = 0
    for when, count in rec.samples:
        if when > t:
            break
        n = count
    return n
