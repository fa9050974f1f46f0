"""Control calls of the TokenizerManager: request-reply messages to the scheduler(s).

Each sends one message and waits for one reply per DP replica (answered in FIFO order):
flush_cache, get_internal_state, and SGLang's RL-facing control plane:
- update_weights_from_disk / _from_tensor / _from_distributed take the model-update lock as writer
  (generation_gate.py): the requests in flight finish first (or are aborted, with
  abort_all_requests), arrivals wait, then the schedulers load the weights and flush the radix
  cache. While paused the update goes through at once (the schedulers refuse if a paused request
  still holds KV and a flush is asked). A successful update with a weight_version sets it.
- init/destroy_weights_update_group: the schedulers join (leave) a trainer's process group; the
  join blocks them until the trainer and every rank are there.
- update_weight_version: only the version string (SGLang's), after aborting the requests in
  flight when asked.
- get_weights_by_name: the unsharded parameter's first rows (one list per DP replica with dp > 1).
- release/resume_memory_occupation: the schedulers refuse while requests run.
- pause_generation: "abort" aborts every request in flight and returns once all are answered;
  "retract" and "in_place" pause the schedulers. Arrivals wait until continue_generation.
health_generate probes whether the engine makes progress.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional, Protocol, Sequence, Union

from engine.tokenizer.embedding_requests import EmbeddingReqInput
from engine.errors import EngineRequestError
from engine.tokenizer.generation_gate import GenerationGate
from engine.io_struct import (
    CONTROL_REPLIES,
    CONTROL_REPLY_OF,
    ContinueGenerationReqInput,
    DestroyWeightsUpdateGroupReqInput,
    ExpertDistributionReq,
    ExpertDistributionReqOutput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetWeightsByNameReqInput,
    InitWeightsUpdateGroupReqInput,
    LoadLoRAAdapterReqInput,
    Message,
    Routed,
    PauseGenerationReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
)
from engine.tokenizer.request_normalizer import GenerateReqInput

if TYPE_CHECKING:
    from engine.server_args import ServerArgs
    from engine.tokenizer.lora_registry import LoRARegistry
    from engine.tokenizer.embedding_requests import EmbeddingReqInput, EmbeddingResult


class ControlHost(Protocol):
    """What the control calls use of the TokenizerManager that owns them: its sockets, its liveness,
    and a generate/encode for the health probe."""

    @property
    def server_args(self) -> ServerArgs: ...

    @property
    def is_generation(self) -> bool: ...

    @property
    def last_output_tstamp(self) -> float:
        """When generated output last arrived (a sign that batches finish)."""

    def auto_create_handle_loop(self) -> None: ...

    def check_alive(self) -> None:
        """Raise if the engine can no longer answer (a child died, or shutting down)."""

    def is_alive(self) -> bool: ...

    async def send_async(self, msg: Routed) -> None: ...

    def generate_request(self, obj: GenerateReqInput) -> AsyncIterator[Union[dict, list[dict]]]: ...

    async def encode_request(self, obj: EmbeddingReqInput) -> list[EmbeddingResult]: ...

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None: ...

    @property
    def lora_registry(self) -> Optional[LoRARegistry]:
        """The LoRA adapters requests may name (None without --enable-lora)."""

    def set_model_path(self, model_path: str) -> None:
        """The weights served now come from this path (after update_weights_from_disk)."""

logger = logging.getLogger(__name__)

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
PAUSE_MODES = ("abort", "retract", "in_place")
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

    def __init__(self, manager: ControlHost, fan_out: int) -> None:
        self.manager = manager
        # Callers waiting for a control reply, one FIFO per reply type.
        self._waiters: dict[type, _ReplyWaiters] = {t: _ReplyWaiters(fan_out) for t in CONTROL_REPLIES}
        # Concurrent /health_generate calls share this one in-flight probe.
        self._health_probe: Optional[asyncio.Future] = None
        # Pause and the model-update lock, passed by every request.
        self.gate = GenerationGate()
        self.weight_version = manager.server_args.weight_version

    def on_reply(self, msg: Message) -> bool:
        """Hand a control reply to its waiter; False if `msg` is not a control reply."""
        waiters = self._waiters.get(type(msg))
        if waiters is None:
            return False
        waiters.on_reply(msg)
        return True

    def fail_all(self, error: Exception) -> None:
        for waiters in self._waiters.values():
            waiters.fail_all(error)

    def waiting_for(self, reply_type: type) -> int:
        """How many calls wait for a reply of this type."""
        return len(self._waiters[reply_type].waiters)

    async def flush_cache(self) -> FlushCacheReqOutput:
        replies = await self.call(FlushCacheReqInput())
        success = all(r.success for r in replies)
        message = "; ".join(r.message for r in replies if r.message)
        return FlushCacheReqOutput(success=success, message=message)

    async def get_internal_state(self) -> list[dict]:
        replies = await self.call(GetInternalStateReq())
        return [dict(r.internal_state) for r in replies]

    async def expert_distribution(self, action: str) -> ExpertDistributionReqOutput:
        """SGLang's expert distribution recording ("start_record", "stop_record", "dump_record"); with
        DP replicas, a dump adds their counts."""
        replies = await self.call(ExpertDistributionReq(action=action))
        failed = [r.message for r in replies if not r.success]
        if failed:
            return ExpertDistributionReqOutput(False, failed[0])
        counts = [r.logical_count for r in replies if r.logical_count is not None]
        total = ([[sum(values) for values in zip(*rows)] for rows in zip(*counts)] if counts else None)
        return ExpertDistributionReqOutput(True, replies[0].message, logical_count=total)

    @property
    def _weight_timeout(self) -> float:
        """How long weight and memory calls wait for a reply (--weight-update-timeout)."""
        return self.manager.server_args.weight_update_timeout

    async def call(self, msg: Routed, timeout: Optional[float] = None) -> list:
        """Send a control request; its replies, one per DP replica (503 on no reply within
        `timeout`, --control-timeout by default)."""
        self.manager.auto_create_handle_loop()
        self.manager.check_alive()
        if timeout is None:
            timeout = self.manager.server_args.control_timeout
        waiters = self._waiters[CONTROL_REPLY_OF[type(msg)]]
        future = waiters.add()
        try:
            await self.manager.send_async(msg)
        except BaseException:
            # Never sent: no reply will come, so this waiter must not consume someone else's.
            for j, (f, _) in enumerate(waiters.waiters):
                if f is future:
                    del waiters.waiters[j]
                    break
            raise
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout=timeout)
        except asyncio.TimeoutError:
            raise EngineRequestError(f"{type(msg).__name__} got no reply within {timeout:.0f} s.",
                                     503, "ServiceUnavailableError") from None

    async def health_generate(self, timeout: Optional[float] = None) -> bool:
        """True if the engine shows it can make progress within `timeout` seconds
        (--health-check-timeout by default).

        Concurrent callers share one in-flight probe, so a flood of health checks on a slow or
        stuck server never piles probe requests into the scheduler's queue.
        """
        if not self.manager.is_alive():
            return False
        if self.gate.busy_by_design():
            # Paused or updating weights on purpose: a probe would only wait in line.
            return True
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
        args = self.manager.server_args
        bootstrap: dict[str, Any] = {}
        if args.disaggregation_mode != "null":
            # As SGLang: a PD server probes itself through the fake transfer (no peer needed).
            from engine.disaggregation.base import FAKE_BOOTSTRAP_HOST

            bootstrap = {"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_port": args.disaggregation_bootstrap_port,
                         "bootstrap_room": random.randrange(1, 2**63)}
        obj = GenerateReqInput(
            input_ids=[0],
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            rid=f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}",
            **bootstrap,
        )

        async def run_probe() -> bool:
            if not self.manager.is_generation:  # an embedding server gets a 1-token embedding probe
                await self.manager.encode_request(EmbeddingReqInput(input_ids=[0], rid=obj.rid))
                return True
            result: dict = {}
            async for out in self.manager.generate_request(obj):
                assert isinstance(out, dict)  # one prompt: one dict per output
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

    # ------------------------------------------------------------------ pause / continue
    async def pause_generation(self, mode: str = "abort") -> dict:
        if mode not in PAUSE_MODES:
            raise EngineRequestError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}.")
        self.gate.pause()
        if mode == "abort":
            # SGLang: abort everything in flight and return once every request is answered.
            self.manager.abort_request(abort_all=True)
            await asyncio.wait_for(self.gate.model_update_lock.wait_no_readers(), timeout=self._weight_timeout)
            return {"success": True, "message": "Generation paused (abort).", "num_paused_requests": 0}
        replies = await self.call(PauseGenerationReqInput(mode=mode), self._weight_timeout)
        return {"success": all(r.success for r in replies), "message": _join(replies),
                "num_paused_requests": sum(r.num_paused_requests for r in replies)}

    async def continue_generation(self, torch_empty_cache: bool = True) -> dict:
        replies = await self.call(ContinueGenerationReqInput(torch_empty_cache=torch_empty_cache),
                                  self._weight_timeout)
        self.gate.resume()
        return {"success": all(r.success for r in replies), "message": _join(replies)}

    # ------------------------------------------------------------------ weights
    async def update_weights_from_disk(self, obj: UpdateWeightFromDiskReqInput) -> tuple[bool, str, int]:
        replies = await self._update_weights(obj, obj.abort_all_requests)
        success = all(r.success for r in replies)
        message = _join(replies)
        if success:
            self.manager.set_model_path(obj.model_path)
            message = self._set_weight_version(obj.weight_version, message)
        return success, message, sum(r.num_paused_requests for r in replies)

    async def update_weights_from_tensor(
        self, named_tensors: Sequence[tuple[str, Any]], load_format: Optional[str] = None,
        flush_cache: bool = True, abort_all_requests: bool = False, weight_version: Optional[str] = None,
    ) -> tuple[bool, str]:
        """The offline Engine's form: the tensors travel as one safetensors payload for every rank."""
        return await self.update_weights_from_tensor_payloads(
            [serialize_named_tensors(named_tensors)], load_format=load_format, flush_cache=flush_cache,
            abort_all_requests=abort_all_requests, weight_version=weight_version)

    async def update_weights_from_tensor_payloads(
        self, payloads: list[bytes], load_format: Optional[str] = None, flush_cache: bool = True,
        abort_all_requests: bool = False, weight_version: Optional[str] = None,
    ) -> tuple[bool, str]:
        """SGLang's form: one payload per TP rank (or one for all), decoded by the schedulers."""
        obj = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payloads, load_format=load_format,
                                              flush_cache=flush_cache, abort_all_requests=abort_all_requests,
                                              weight_version=weight_version)
        return await self._update_and_version(obj, abort_all_requests, weight_version)

    async def update_weights_from_distributed(self, obj: UpdateWeightsFromDistributedReqInput) -> tuple[bool, str]:
        return await self._update_and_version(obj, obj.abort_all_requests, obj.weight_version)

    async def _update_and_version(self, obj: Routed, abort_all: bool, weight_version: Optional[str]
                                  ) -> tuple[bool, str]:
        replies = await self._update_weights(obj, abort_all)
        success = all(r.success for r in replies)
        message = _join(replies)
        if success:
            message = self._set_weight_version(weight_version, message)
        return success, message

    async def init_weights_update_group(self, obj: InitWeightsUpdateGroupReqInput) -> tuple[bool, str]:
        dp_size = self.manager.server_args.dp_size
        if dp_size > 1:
            # Every replica's TP rank r would claim rank rank_offset + r: one server per replica.
            return False, (f"init_weights_update_group is not supported with --dp-size {dp_size}: run one server "
                           "per replica, each with its own rank_offset.")
        tp_size = self.manager.server_args.tp_size
        if obj.rank_offset < 1 or obj.rank_offset + tp_size > obj.world_size:
            return False, (f"This server's {tp_size} rank(s) join as ranks rank_offset..rank_offset+{tp_size - 1}, "
                           f"which must lie within 1..world_size-1 (rank 0 is the trainer): rank_offset "
                           f"{obj.rank_offset}, world_size {obj.world_size}.")
        return _outcome(await self.call(obj, self._weight_timeout))

    async def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]:
        return _outcome(await self.call(DestroyWeightsUpdateGroupReqInput(group_name=group_name),
                                        self._weight_timeout))

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> tuple[bool, str]:
        if abort_all_requests:
            self.manager.abort_request(abort_all=True)
        self.weight_version = new_version
        return True, f"Weight version updated to {new_version}"

    async def _update_weights(self, obj: Routed, abort_all: bool) -> list:
        if abort_all:
            self.manager.abort_request(abort_all=True)
        async with self.gate.weight_update():
            return await self.call(obj, self._weight_timeout)

    def _set_weight_version(self, version: Optional[str], message: str) -> str:
        if version is None:
            return message
        self.weight_version = version
        return f"{message} Weight version updated to {version}."

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        replies = await self.call(GetWeightsByNameReqInput(name=name, truncate_size=truncate_size))
        failed = [r.message for r in replies if r.parameter is None]
        if failed:
            raise EngineRequestError(failed[0] or "Get parameter by name failed")
        parameters = [r.parameter for r in replies]
        return parameters[0] if len(parameters) == 1 else parameters

    # ------------------------------------------------------------------ memory
    async def release_memory_occupation(self, tags: Optional[list[str]] = None) -> dict:
        return _result(await self.call(ReleaseMemoryOccupationReqInput(tags=tags), self._weight_timeout))

    async def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> dict:
        return _result(await self.call(ResumeMemoryOccupationReqInput(tags=tags), self._weight_timeout))


async def _lora_registry_of(manager: ControlHost) -> LoRARegistry:
    registry = manager.lora_registry
    if registry is None:
        raise EngineRequestError("LoRA is not enabled on this server (start it with --enable-lora or --lora-paths).")
    if manager.server_args.tokenizer_worker_num > 1:
        # Each HTTP worker keeps its own registry: one worker's load would be unknown to the others.
        raise EngineRequestError("Loading and unloading LoRA adapters is not supported with "
                                 "--tokenizer-worker-num > 1; give the adapters with --lora-paths.")
    return registry


async def load_lora_adapter(calls: "ControlCalls", name: str, path: str, pinned: bool) -> dict:
    """/load_lora_adapter: every scheduler loads it; then requests may name it."""
    registry = await _lora_registry_of(calls.manager)
    if name in registry.adapters():
        return {"success": False, "message": f"LoRA adapter {name!r} is already loaded; unload it first.",
                "loaded_adapters": registry.adapters()}
    replies = await calls.call(LoadLoRAAdapterReqInput(lora_name=name, lora_path=path, pinned=pinned),
                               timeout=calls.manager.server_args.weight_update_timeout)
    success, message = _outcome(replies)
    if success:
        registry.register(name, path)
    return {"success": success, "message": message, "loaded_adapters": registry.adapters()}


async def unload_lora_adapter(calls: "ControlCalls", name: str) -> dict:
    """/unload_lora_adapter: new requests naming it get a 400 at once; the call waits (up to
    --weight-update-timeout) for the requests in flight that use it, then the schedulers unload it."""
    registry = await _lora_registry_of(calls.manager)
    path = registry.unregister(name)
    if path is None:
        return {"success": False, "message": f"LoRA adapter {name!r} is not loaded.",
                "loaded_adapters": registry.adapters()}
    timeout = calls.manager.server_args.weight_update_timeout
    if not await registry.wait_unused(name, timeout):
        registry.register(name, path)
        return {"success": False, "message": f"LoRA adapter {name!r} is still used by requests after {timeout:.0f} s; "
                "not unloaded.", "loaded_adapters": registry.adapters()}
    replies = await calls.call(UnloadLoRAAdapterReqInput(lora_name=name), timeout=timeout)
    success, message = _outcome(replies)
    if not success:
        registry.register(name, path)
    return {"success": success, "message": message, "loaded_adapters": registry.adapters()}


def serialize_named_tensors(named_tensors: Sequence[tuple[str, Any]]) -> bytes:
    """One safetensors payload (no pickle crosses the process boundary)."""
    import torch
    from safetensors.torch import save

    tensors = {}
    for name, tensor in named_tensors:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise EngineRequestError("named_tensors must be (name, torch.Tensor) pairs.")
        if name in tensors:
            raise EngineRequestError(f"Weight {name!r} appears twice in named_tensors.")
        # Own contiguous CPU copies: safetensors refuses views that share memory.
        tensors[name] = tensor.detach().to("cpu").contiguous().clone()
    return save(tensors)


def _join(replies: list) -> str:
    messages: list[str] = []
    for reply in replies:
        if reply.message and reply.message not in messages:
            messages.append(reply.message)
    return " | ".join(messages)


def _outcome(replies: list) -> tuple[bool, str]:
    return all(r.success for r in replies), _join(replies)


def _result(replies: list) -> dict:
    return {"success": all(r.success for r in replies), "message": _join(replies)}


def _probe_succeeded(probe: asyncio.Future) -> bool:
    if probe.cancelled():
        return False
    error = probe.exception()
    if error is not None:
        if not isinstance(error, EngineRequestError):
            logger.warning("Health check probe failed: %r", error)
        return False
    return bool(probe.result())
