"""The offline Engine: the server's subprocesses and TokenizerManager, without HTTP.

It starts them as `launch_server` does (launch/processes.py). The Engine runs the TokenizerManager's asyncio loop in a background thread of its own, so its
synchronous methods work from plain code and its async methods from any other event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator, Optional, Sequence, Union

from engine.tokenizer.embedding_requests import EmbeddingReqInput
from engine.errors import EngineRequestError
from engine.io_struct import (
    InitWeightsUpdateGroupReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
)
from engine.tokenizer.control_calls import load_lora_adapter, unload_lora_adapter
from engine.tokenizer.request_normalizer import GENERATE_FIELDS, GenerateReqInput
from engine.tokenizer.tokenizer_manager import TokenizerManager
from engine.launch.processes import launch_subprocesses
from engine.server_args import ServerArgs, ServerArgsError
from engine.launch.children import ChildProcesses

if TYPE_CHECKING:
    import torch


logger = logging.getLogger(__name__)

# How often a blocked Engine call checks that something can still answer it.
LIVENESS_POLL_S = 0.5
# A call still pending this long after the engine was found dead is ended here: the death should
# have ended it with its own error first.
DEAD_GRACE_S = 5.0


def _report_child_death(tokenizer_manager: TokenizerManager, name: str, pid: int, exitcode: Any) -> None:
    message = f"Child process {name} ({pid}) died with exit code {exitcode}."
    logger.error("%s The engine can no longer serve requests.", message)
    tokenizer_manager.mark_dead(message)


class _Runtime:
    """What an Engine owns; closed by a weakref finalizer so a forgotten Engine leaves no children."""

    def __init__(self, children: ChildProcesses, tokenizer_manager: TokenizerManager) -> None:
        self.children = children
        self.tokenizer_manager = tokenizer_manager
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run_loop, name="engine-event-loop", daemon=True)
        self.thread.start()

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def close(self) -> None:
        self.tokenizer_manager.mark_dead("The engine was shut down.")
        if self.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._drain(), self.loop).result(timeout=5.0)
            except Exception:  # a stuck loop must not block shutdown; the children still die
                logger.warning("The engine's event loop did not stop cleanly", exc_info=True)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5.0)
        self.children.shutdown()
        self.tokenizer_manager.close()
        if not self.loop.is_running():
            self.loop.close()

    def unavailable(self) -> Optional[Exception]:
        """Why a pending call can never be answered, or None while it still can be."""
        if not self.thread.is_alive() or not self.loop.is_running():
            return RuntimeError("The engine's event loop stopped, so this call cannot be answered; "
                                "shut the engine down and start a new one.")
        return self.tokenizer_manager.unavailable_error()

    async def _drain(self) -> None:
        """Let failed requests see their error, then stop receiving and finalize generators."""
        await asyncio.sleep(0)
        await self.tokenizer_manager.stop_handle_loop()
        await self.loop.shutdown_asyncgens()


class Engine:
    """Offline inference: `Engine(model_path=None, **server_args)`; see the module docstring."""

    def __init__(self, model_path: Optional[str] = None, **server_args_kwargs: Any) -> None:
        server_args = ServerArgs(model_path=model_path, **server_args_kwargs)
        if server_args.tokenizer_worker_num != 1:
            raise ServerArgsError("tokenizer_worker_num: the offline Engine has no HTTP workers; leave it at 1.")
        self.server_args, children, tokenizer_manager = launch_subprocesses(server_args)
        self.tokenizer_manager = tokenizer_manager
        self._runtime = _Runtime(children, tokenizer_manager)
        self._finalizer = weakref.finalize(self, self._runtime.close)
        self._run(self._start_handle_loop())
        # The watchdog must not hold the Engine itself, or a forgotten Engine would never be freed.
        children.start_watchdog(functools.partial(_report_child_death, tokenizer_manager))

    async def _start_handle_loop(self) -> None:
        self.tokenizer_manager.auto_create_handle_loop()

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompt: Optional[Union[str, list[str]]] = None,
        sampling_params: Optional[Union[dict, list[dict]]] = None,
        input_ids: Optional[Union[list[int], list[list[int]]]] = None,
        return_logprob: Union[bool, list[bool]] = False,
        logprob_start_len: Optional[Union[int, list[int]]] = None,
        top_logprobs_num: Optional[Union[int, list[int]]] = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: Optional[Union[str, list[str]]] = None,
        **extras: Any,
    ) -> Union[dict, list[dict], Iterator[dict]]:
        """Generate for one prompt (a dict) or a batch (a list); stream=True gives an iterator.

        `extras`: every other field of SGLang's GenerateReqInput the engine implements: the request
        options of request_options.py (token_ids_logprob, return_hidden_states, priority, extra_key,
        ...), data_parallel_rank and custom_labels (docs/api.md).
        """
        obj = self._make_request(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                 top_logprobs_num, return_text_in_logprobs, stream, rid, extras)
        outputs = self.tokenizer_manager.generate_request(
            obj, incremental=self.tokenizer_manager.server_args.incremental_streaming_output)
        if stream:
            return self._iterate_sync(outputs)
        return self._run(_last(outputs))

    def async_generate(
        self,
        prompt: Optional[Union[str, list[str]]] = None,
        sampling_params: Optional[Union[dict, list[dict]]] = None,
        input_ids: Optional[Union[list[int], list[list[int]]]] = None,
        return_logprob: Union[bool, list[bool]] = False,
        logprob_start_len: Optional[Union[int, list[int]]] = None,
        top_logprobs_num: Optional[Union[int, list[int]]] = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: Optional[Union[str, list[str]]] = None,
        **extras: Any,
    ) -> Any:
        """A coroutine giving the result, or with stream=True an async iterator of outputs.

        The stream object may also be awaited first (`gen = await engine.async_generate(...,
        stream=True)`), as SGLang's Engine is used. `extras` as for generate().
        """
        obj = self._make_request(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                 top_logprobs_num, return_text_in_logprobs, stream, rid, extras)
        outputs = self.tokenizer_manager.generate_request(
            obj, incremental=self.tokenizer_manager.server_args.incremental_streaming_output)
        if stream:
            return _AsyncStream(self, outputs)
        return self._await_in_engine_loop(_last(outputs))

    @staticmethod
    def _make_request(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                      top_logprobs_num, return_text_in_logprobs, stream, rid, extras) -> GenerateReqInput:
        # Every GenerateReqInput field not named in the signature; "text" is `prompt` here.
        unknown = sorted(name for name in extras if name not in GENERATE_FIELDS or name == "text")
        if unknown:
            raise TypeError(f"generate() got unexpected keyword argument(s) {', '.join(unknown)}")
        return GenerateReqInput(
            **extras,
            text=prompt,
            input_ids=input_ids,
            sampling_params=sampling_params,
            rid=rid,
            stream=stream,
            return_logprob=return_logprob,
            logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
            top_logprobs_num=0 if top_logprobs_num is None else top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
        )

    def _iterate_sync(self, outputs: AsyncIterator[Union[dict, list[dict]]]) -> Iterator[dict]:
        try:
            while True:
                try:
                    item = self._run(_next(outputs))
                except StopAsyncIteration:
                    return
                yield item
        finally:
            # Closing the generator aborts an unfinished request in the scheduler.
            if self._runtime.loop.is_running():
                self._run(_aclose(outputs))

    # ------------------------------------------------------------------ encode (embedding models)
    def encode(
        self,
        prompt: Optional[Union[str, list[str]]] = None,
        input_ids: Optional[Union[list[int], list[list[int]]]] = None,
        dimensions: Optional[int] = None,
        rid: Optional[Union[str, list[str]]] = None,
    ) -> Union[dict, list[dict]]:
        """Embed one input (a dict) or a batch (a list of dicts), as SGLang's Engine.encode:
        {"embedding": [floats], "meta_info": {"id", "prompt_tokens", "cached_tokens", ...}}."""
        obj = EmbeddingReqInput(text=prompt, input_ids=input_ids, rid=rid, dimensions=dimensions)
        return self._run(_encode(self.tokenizer_manager, obj))

    def async_encode(
        self,
        prompt: Optional[Union[str, list[str]]] = None,
        input_ids: Optional[Union[list[int], list[list[int]]]] = None,
        dimensions: Optional[int] = None,
        rid: Optional[Union[str, list[str]]] = None,
    ) -> Any:
        """A coroutine giving what `encode` returns, awaitable from any event loop."""
        obj = EmbeddingReqInput(text=prompt, input_ids=input_ids, rid=rid, dimensions=dimensions)
        return self._await_in_engine_loop(_encode(self.tokenizer_manager, obj))

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> bool:
        return self._run(self.tokenizer_manager.flush_cache()).success

    def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None,
                                 abort_all_requests: bool = False, weight_version: Optional[str] = None,
                                 flush_cache: bool = True) -> tuple[bool, str, int]:
        """Load a new checkpoint of the same architecture: (success, message, num_paused_requests)."""
        obj = UpdateWeightFromDiskReqInput(model_path=model_path, load_format=load_format,
                                           abort_all_requests=abort_all_requests, weight_version=weight_version,
                                           flush_cache=flush_cache)
        return self._run(self.tokenizer_manager.control.update_weights_from_disk(obj))

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, Any]], load_format: Optional[str] = None,
                                   flush_cache: bool = True, abort_all_requests: bool = False,
                                   weight_version: Optional[str] = None) -> tuple[bool, str]:
        """Set the named weights (full, unsharded tensors, checkpoint names): (success, message)."""
        return self._run(self.tokenizer_manager.control.update_weights_from_tensor(
            named_tensors, load_format=load_format, flush_cache=flush_cache,
            abort_all_requests=abort_all_requests, weight_version=weight_version))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> tuple[bool, str]:
        """Join a trainer's process group (the trainer is rank 0 and hosts the rendezvous at
        master_address:master_port; TP rank r joins as rank_offset + r): (success, message)."""
        obj = InitWeightsUpdateGroupReqInput(master_address=master_address, master_port=master_port,
                                             rank_offset=rank_offset, world_size=world_size, group_name=group_name,
                                             backend=backend)
        return self._run(self.tokenizer_manager.control.init_weights_update_group(obj))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> tuple[bool, str]:
        return self._run(self.tokenizer_manager.control.destroy_weights_update_group(group_name))

    def update_weights_from_distributed(self, names: list[str], dtypes: list[Union[str, torch.dtype]],
                                        shapes: list[Sequence[int]], group_name: str = "weight_update_group",
                                        flush_cache: bool = True, load_format: Optional[str] = None,
                                        abort_all_requests: bool = False,
                                        weight_version: Optional[str] = None) -> tuple[bool, str]:
        """Receive the named full tensors the trainer broadcasts from rank 0, in this order, and load
        them: (success, message)."""
        obj = UpdateWeightsFromDistributedReqInput(
            names=list(names), dtypes=[str(d) for d in dtypes], shapes=[[int(x) for x in s] for s in shapes],
            group_name=group_name, flush_cache=flush_cache, abort_all_requests=abort_all_requests,
            weight_version=weight_version, load_format=load_format)
        return self._run(self.tokenizer_manager.control.update_weights_from_distributed(obj))

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> tuple[bool, str]:
        return self._run(self.tokenizer_manager.control.update_weight_version(new_version, abort_all_requests))

    def get_weight_version(self) -> str:
        return self.tokenizer_manager.control.weight_version

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` rows of a weight, by its checkpoint name, unsharded."""
        return self._run(self.tokenizer_manager.control.get_weights_by_name(name, truncate_size))

    def release_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        """Free the KV cache and/or the weights ("kv_cache", "weights"; default both)."""
        self._check_control(self._run(self.tokenizer_manager.control.release_memory_occupation(tags)))

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        self._check_control(self._run(self.tokenizer_manager.control.resume_memory_occupation(tags)))

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict:
        """Load a PEFT adapter while serving (SGLang's); requests name it in lora_path. Returns
        {"success", "message", "loaded_adapters"}; EngineRequestError without --enable-lora."""
        return self._run(load_lora_adapter(self.tokenizer_manager.control, lora_name, lora_path, pinned))

    def unload_lora_adapter(self, lora_name: str) -> dict:
        """Unload an adapter: new requests naming it are refused at once; waits for those in flight."""
        return self._run(unload_lora_adapter(self.tokenizer_manager.control, lora_name))

    def pause_generation(self, mode: str = "abort") -> None:
        """Pause ("abort", "retract" or "in_place", as SGLang); new requests wait until continue."""
        self._check_control(self._run(self.tokenizer_manager.control.pause_generation(mode)))

    def continue_generation(self, torch_empty_cache: bool = True) -> None:
        self._check_control(self._run(self.tokenizer_manager.control.continue_generation(torch_empty_cache)))

    @staticmethod
    def _check_control(result: dict) -> None:
        if not result["success"]:
            raise EngineRequestError(result["message"])

    # Mixture-of-experts models (SGLang's names). The dump returns the counts, [layer][expert id],
    # where SGLang's writes a file. A dense model raises EngineRequestError.
    def start_expert_distribution_record(self) -> None:
        self._expert_distribution("start_record")

    def stop_expert_distribution_record(self) -> None:
        self._expert_distribution("stop_record")

    def dump_expert_distribution_record(self) -> list[list[int]]:
        return self._expert_distribution("dump_record") or []

    def _expert_distribution(self, action: str) -> Optional[list[list[int]]]:
        result = self._run(self.tokenizer_manager.control.expert_distribution(action))
        if not result.success:
            raise EngineRequestError(result.message)
        return result.logical_count

    def get_internal_state(self) -> list[dict]:
        return self._run(self.tokenizer_manager.get_internal_state())

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.tokenizer_manager.abort_request(rid=rid, abort_all=abort_all)

    def get_model_info(self) -> dict:
        return self.tokenizer_manager.get_model_info()

    def is_alive(self) -> bool:
        return self.tokenizer_manager.is_alive()

    def shutdown(self) -> None:
        """Stop the event loop and kill every child process (idempotent)."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter teardown: nothing sensible left to do
            pass

    # ------------------------------------------------------------------ loop bridging
    # A call runs in the engine's loop; the caller waits for it, but never forever: every
    # LIVENESS_POLL_S it checks that the loop still runs and the engine is alive (_Waiter).
    def _run(self, coro: Any) -> Any:
        future = self._submit(coro)
        waiter = _Waiter(self._runtime)
        while True:
            try:
                return future.result(timeout=LIVENESS_POLL_S)
            except concurrent.futures.TimeoutError:
                waiter.check(future)

    async def _await_in_engine_loop(self, coro: Any) -> Any:
        wrapped = asyncio.wrap_future(self._submit(coro))
        waiter = _Waiter(self._runtime)
        try:
            while True:
                done, _ = await asyncio.wait({wrapped}, timeout=LIVENESS_POLL_S)
                if done:
                    return wrapped.result()
                waiter.check(wrapped)
        except asyncio.CancelledError:
            wrapped.cancel()  # the caller gave up: so does the call in the engine's loop (an abort)
            raise

    def _submit(self, coro: Any) -> concurrent.futures.Future:
        if not self._runtime.loop.is_running():
            coro.close()
            raise RuntimeError("The engine is shut down.")
        return asyncio.run_coroutine_threadsafe(coro, self._runtime.loop)


class _Waiter:
    """Ends a wait on the engine's loop with a clear error once nothing can answer it."""

    def __init__(self, runtime: _Runtime) -> None:
        self.runtime = runtime
        self.dead_since: Optional[float] = None

    def check(self, future: Any) -> None:
        error = self.runtime.unavailable()
        if error is None:
            self.dead_since = None
            return
        now = time.monotonic()
        if isinstance(error, EngineRequestError):
            # Dead children: the engine fails its own requests at once; give that a moment.
            if self.dead_since is None:
                self.dead_since = now
            if now - self.dead_since < DEAD_GRACE_S:
                return
        future.cancel()
        raise error


class _AsyncStream:
    """An async iterator over a stream running in the engine's loop; awaiting it returns itself."""

    def __init__(self, engine: Engine, outputs: AsyncIterator[Union[dict, list[dict]]]) -> None:
        self._engine = engine
        self._outputs = outputs

    def __await__(self):
        async def itself() -> "_AsyncStream":
            return self

        return itself().__await__()

    def __aiter__(self) -> "_AsyncStream":
        return self

    async def __anext__(self) -> dict:
        try:
            return await self._engine._await_in_engine_loop(_next(self._outputs))
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        if self._engine._runtime.loop.is_running():
            await self._engine._await_in_engine_loop(_aclose(self._outputs))


async def _next(outputs: AsyncIterator[Union[dict, list[dict]]]) -> dict:
    out = await outputs.__anext__()
    assert isinstance(out, dict)  # a stream yields one dict per output; only a whole batch is a list
    return out


async def _aclose(outputs: Any) -> None:
    await outputs.aclose()


async def _encode(tokenizer_manager: TokenizerManager, obj: EmbeddingReqInput) -> Union[dict, list[dict]]:
    results = [r.to_dict() for r in await tokenizer_manager.encode_request(obj)]
    return results[0] if obj.is_single else results


async def _last(outputs: AsyncIterator[Any]) -> Any:
    result = None
    async for out in outputs:
        result = out
    return result
