"""Consuming several async streams at once: the outputs of a batch request's sub-requests."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Sequence


async def gather_last(streams: Sequence[AsyncIterator[dict]]) -> list[dict]:
    """The last item of each stream ({} for one that yields none), the streams consumed concurrently.
    If one raises, the error propagates and the others are cancelled."""

    async def last(stream: AsyncIterator[dict]) -> dict:
        result: dict = {}
        async for out in stream:
            result = out
        return result

    tasks = [asyncio.ensure_future(last(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def merge_indexed(streams: Sequence[AsyncIterator[dict]]) -> AsyncIterator[dict]:
    """Every stream's items as they come, each with its stream's position in `streams` as "index".
    The first error of a stream (other than its cancellation) propagates; when the consumer
    stops, every stream is cancelled."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[dict]) -> None:
        try:
            async for out in stream:
                out["index"] = index
                queue.put_nowait(("out", out))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer below
            queue.put_nowait(("error", e))
            raise
        finally:
            queue.put_nowait(("done", None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            kind, payload = await queue.get()
            if kind == "out":
                yield payload
            elif kind == "error":
                if not isinstance(payload, asyncio.CancelledError):
                    raise payload
            else:
                remaining -= 1
    finally:
        for task in tasks:
            task.cancel()
