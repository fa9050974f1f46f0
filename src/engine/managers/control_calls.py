"""Control calls of the TokenizerManager: request-reply messages to the scheduler(s).

flush_cache and get_internal_state send one message and wait for one reply per DP replica
(answered in FIFO order); health_generate probes whether the engine makes progress.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from typing import TYPE_CHECKING, Optional

from engine.managers.errors import EngineRequestError
from engine.managers.io_struct import (
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    Message,
)
from engine.managers.request_normalizer import GenerateReqInput

if TYPE_CHECKING:
    from engine.managers.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
# How often a health probe on a busy server asks the scheduler whether forwards advance.
HEALTH_CHECK_PROGRESS_POLL_S = 0.25


class _ReplyWaiters:
    """Callers waiting for one kind of control reply, answered in FIFO order.

    The scheduler answers control requests in the order it receives them, and each request
    gets `fan_out` replies (one per DP replica). A caller that timed out stays queued so that its
    late reply is consumed by it rather than handed to the next caller.
    """

    def __init__(self, fan_out: int) -> None:
        self.fan_out = fan_out
        self.waiters: collections.deque[tuple[asyncio.Future, list]] = collections.deque()

    def add(self) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.waiters.append((future, []))
        return future

    def on_reply(self, reply: Message) -> None:
        if not self.waiters:
            logger.warning("Unexpected control reply %s with no waiter", type(reply).__name__)
            return
        future, replies = self.waiters[0]
        replies.append(reply)
        if len(replies) >= self.fan_out:
            self.waiters.popleft()
            if not future.done():
                future.set_result(replies)

    def fail_all(self, error: Exception) -> None:
        while self.waiters:
            future, _ = self.waiters.popleft()
            if not future.done():
                future.set_exception(error)



class ControlCalls:
    """The control calls of one TokenizerManager, whose sockets and receive loop they use."""

    def __init__(self, manager: TokenizerManager, fan_out: int) -> None:
        self.manager = manager
        self.flush_waiters = _ReplyWaiters(fan_out)
        self.state_waiters = _ReplyWaiters(fan_out)
        # Concurrent /health_generate calls share this one in-flight probe.
        self._health_probe: Optional[asyncio.Future] = None

    def on_reply(self, msg: Message) -> bool:
        """Hand a control reply to its waiter; False if `msg` is not a control reply."""
        if isinstance(msg, FlushCacheReqOutput):
            self.flush_waiters.on_reply(msg)
        elif isinstance(msg, GetInternalStateReqOutput):
            self.state_waiters.on_reply(msg)
        else:
            return False
        return True

    def fail_all(self, error: Exception) -> None:
        self.flush_waiters.fail_all(error)
        self.state_waiters.fail_all(error)

    async def flush_cache(self) -> FlushCacheReqOutput:
        replies = await self._control_call(FlushCacheReqInput(), self.flush_waiters)
        success = all(r.success for r in replies)
        message = "; ".join(r.message for r in replies if r.message)
        return FlushCacheReqOutput(success=success, message=message)

    async def get_internal_state(self) -> list[dict]:
        replies = await self._control_call(GetInternalStateReq(), self.state_waiters)
        return [dict(r.internal_state) for r in replies]

    async def _control_call(self, msg: Message, waiters: _ReplyWaiters) -> list:
        self.manager.auto_create_handle_loop()
        self.manager._check_alive()
        future = waiters.add()
        try:
            await self.manager._send_async(msg)
        except BaseException:
            # Never sent: no reply will come, so this waiter must not consume someone else's.
            for j, (f, _) in enumerate(waiters.waiters):
                if f is future:
                    del waiters.waiters[j]
                    break
            raise
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout=self.manager.server_args.control_timeout)
        except asyncio.TimeoutError:
            raise EngineRequestError(f"{type(msg).__name__} got no reply within "
                                     f"{self.manager.server_args.control_timeout:.0f} s.",
                                     503, "ServiceUnavailableError") from None

    async def health_generate(self, timeout: Optional[float] = None) -> bool:
        """True if the engine shows it can make progress within `timeout` seconds
        (--health-check-timeout by default).

        Concurrent callers share one in-flight probe, so a flood of health checks on a slow or
        stuck server never piles probe requests into the scheduler's queue.
        """
        if not self.manager.is_alive():
            return False
        self.manager.auto_create_handle_loop()
        probe = self._health_probe
        if probe is None or probe.done() or probe.get_loop() is not asyncio.get_running_loop():
            if timeout is None:
                timeout = self.manager.server_args.health_check_timeout
            probe = self._health_probe = asyncio.ensure_future(self._run_health_probe(timeout))
        # Shielded: a caller that goes away must not cancel the probe the others wait on.
        return await asyncio.shield(probe)

    async def _run_health_probe(self, timeout: float) -> bool:
        """Send a 1-token request and wait for a sign of progress; abort the probe in any case.

        Idle, the probe itself is the sign. Busy, the probe may wait behind other work, so the
        server counts as healthy as soon as the next batch completes: any generated output
        arrives, or a scheduler's forward_ct advances. A rejected probe (queue full) is no verdict
        either way: the other signs decide. No sign within `timeout`, or a dead child: unhealthy.
        """
        start = time.monotonic()
        deadline = start + timeout
        obj = GenerateReqInput(
            input_ids=[0],
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            rid=f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}",
        )

        async def run_probe() -> bool:
            result: dict = {}
            async for out in self.manager.generate_request(obj):
                result = out
            reason = result.get("meta_info", {}).get("finish_reason") or {}
            return reason.get("type") != "abort"

        probe = asyncio.ensure_future(run_probe())
        progress = asyncio.ensure_future(self._wait_forward_progress(deadline))
        try:
            while True:
                if probe.done() and _probe_succeeded(probe):
                    return True
                if progress.done() and not progress.cancelled() and progress.exception() is None \
                        and progress.result():
                    return True
                if self.manager.last_output_tstamp > start:
                    return True
                if not self.manager.is_alive():
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    logger.warning("Health check timed out after %.1f s: no batch completed.", timeout)
                    return False
                # Wake on either task, or at least every 100 ms for the output and liveness checks.
                pending = {t for t in (probe, progress) if not t.done()}
                if pending:
                    await asyncio.wait(pending, timeout=min(remaining, 0.1), return_when=asyncio.FIRST_COMPLETED)
                else:
                    await asyncio.sleep(min(remaining, 0.1))
        finally:
            # Cancelling the probe's generator aborts the request in the scheduler if it still runs.
            for task in (probe, progress):
                if not task.done():
                    task.cancel()
            await asyncio.gather(probe, progress, return_exceptions=True)

    async def _wait_forward_progress(self, deadline: float) -> bool:
        """True once any scheduler's forward_ct is above what it was at the first reply."""
        baseline: Optional[list[int]] = None
        while time.monotonic() < deadline:
            try:
                states = await asyncio.wait_for(self.get_internal_state(),
                                                timeout=max(0.0, deadline - time.monotonic()))
            except (asyncio.TimeoutError, EngineRequestError):
                return False
            counts = [int(s.get("forward_ct", 0)) for s in states]
            if baseline is None:
                baseline = counts
            elif any(c > b for c, b in zip(counts, baseline)):
                return True
            await asyncio.sleep(HEALTH_CHECK_PROGRESS_POLL_S)
        return False

    # ------------------------------------------------------------------ chat and info


def _probe_succeeded(probe: asyncio.Future) -> bool:
    if probe.cancelled():
        return False
    error = probe.exception()
    if error is not None:
        if not isinstance(error, EngineRequestError):
            logger.warning("Health check probe failed: %r", error)
        return False
    return bool(probe.result())
