"""The gate every request passes in the TokenizerManager: pause and the model-update lock.

Every request holds the model-update lock as a reader from before it is sent until it ends
(SGLang's `model_update_lock`); a weight update takes it as the writer, so it waits for the
requests in flight, and the requests that arrive meanwhile wait for it. While generation is
paused (pause_generation, any mode) arriving requests wait at the gate: nothing is refused or
lost, they go on at continue_generation.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator


class ReadWriteLock:
    """Many readers (requests) or one writer (a weight update); a waiting writer goes first."""

    def __init__(self) -> None:
        self.readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._cond = asyncio.Condition()

    async def acquire_read(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and self._writers_waiting == 0)
            self.readers += 1

    async def release_read(self) -> None:
        async with self._cond:
            self.readers -= 1
            self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def writer(self) -> AsyncIterator[None]:
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and self.readers == 0)
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()

    @property
    def busy_writing(self) -> bool:
        return self._writer or self._writers_waiting > 0

    async def wait_no_readers(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.readers == 0)


class GenerationGate:
    def __init__(self) -> None:
        self.model_update_lock = ReadWriteLock()
        self.is_pause = False
        self._unpaused = asyncio.Event()
        self._unpaused.set()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Held by a request for its whole life; waits while paused or a weight update runs."""
        while True:
            await self._unpaused.wait()
            await self.model_update_lock.acquire_read()
            if not self.is_pause:
                break
            await self.model_update_lock.release_read()  # paused meanwhile: wait again
        try:
            yield
        finally:
            await self.model_update_lock.release_read()

    def pause(self) -> None:
        self.is_pause = True
        self._unpaused.clear()

    def resume(self) -> None:
        self.is_pause = False
        self._unpaused.set()

    def busy_by_design(self) -> bool:
        """Paused or updating weights: requests wait on purpose (health checks pass meanwhile)."""
        return self.is_pause or self.model_update_lock.busy_writing

    def weight_update(self) -> contextlib.AbstractAsyncContextManager:
        """The writer side, except while paused: the paused requests hold the lock as readers,
        and the schedulers judge whether the update may go on."""
        return contextlib.nullcontext() if self.is_pause else self.model_update_lock.writer()
