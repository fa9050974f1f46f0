"""The scheduler's control plane: weights, memory, pause/continue (SGLang's handlers, as one
collaborator of the Scheduler instead of its mixins).

Every TP rank handles the same control message at the same point of its loop (rank 0 broadcasts
what it received), so collectives line up; only rank 0's reply is sent. A handler first settles
the overlap loop: the forward in flight is waited for and its result processed, so nothing reads
the model or the KV pool while they change. Work on the model runs where the forwards run (the
forward thread on the CPU).

States:
- paused (pause_generation in "retract" or "in_place" mode): no batch is scheduled; requests keep
  arriving and wait. "retract" first moves every running request back to the waiting queue with
  its output kept (its KV freed); "in_place" leaves them as they are.
- memory released ("kv_cache" or "weights"): no batch is scheduled either, until both are back
  ("cuda_graph" alone leaves eager forwards running; "weights_drafter" frees nothing here).

Weight update groups (init/destroy_weights_update_group, update_weights_from_distributed): each
rank joins the trainer's group and receives the tensors it broadcasts (distributed/
weight_update_group.py). A request the group cannot receive (no such group, metadata that does
not describe tensors, more bytes than a model's worth) is refused before anything is received;
any other refusal comes after the broadcast, so that the trainer's broadcast always completes.

A "flush" here resets the radix cache and the pools, which needs only that no request holds KV:
requests waiting in the queue (fresh or retracted) hold none and are prefilled later.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Protocol, Set, Tuple

from engine.distributed.parallel_state import all_reduce_min_int, get_tp_size
from engine.io_struct import (
    ContinueGenerationReqInput,
    ContinueGenerationReqOutput,
    DestroyWeightsUpdateGroupReqInput,
    DestroyWeightsUpdateGroupReqOutput,
    GetWeightsByNameReqInput,
    GetWeightsByNameReqOutput,
    InitWeightsUpdateGroupReqInput,
    InitWeightsUpdateGroupReqOutput,
    LoadLoRAAdapterReqInput,
    LoadLoRAAdapterReqOutput,
    PauseGenerationReqInput,
    PauseGenerationReqOutput,
    ReleaseMemoryOccupationReqInput,
    ReleaseMemoryOccupationReqOutput,
    ResumeMemoryOccupationReqInput,
    ResumeMemoryOccupationReqOutput,
    UnloadLoRAAdapterReqInput,
    UnloadLoRAAdapterReqOutput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromDistributedReqOutput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsFromTensorReqOutput,
)
from engine.model_executor.memory_saver import FORWARD_TAGS, MEMORY_TAGS, WEIGHTS, check_tags
from engine.model_executor.tensor_payload import PayloadError, decode_payload

if TYPE_CHECKING:
    from engine.scheduler.overlap_utils import ForwardStream
    from engine.scheduler.worker_protocol import ModelWorker

logger = logging.getLogger(__name__)

PAUSE_MODES = ("retract", "in_place")  # "abort" is the TokenizerManager's alone (SGLang)


class ControlledLoop(Protocol):
    """What the control plane asks of the scheduler loop (the Scheduler sequences its owners)."""

    def settle(self) -> None:
        """Process the results of the forwards in flight: nothing runs afterwards."""

    def retract_all(self) -> None:
        """Every request holding KV goes back to the waiting queue, output kept, KV freed."""

    def live_requests(self) -> int:
        """Requests that hold KV (running, in the last batch, chunked, or in a PD transfer)."""

    def flush_kv(self) -> None:
        """Reset the prefix cache and the pools (no request may hold KV)."""

    def num_waiting(self) -> int: ...

    def requests_using_lora(self, lora_uid: str) -> int:
        """Unfinished requests (waiting, running, chunked) that run with this LoRA adapter."""


class SchedulerControl:
    def __init__(self, loop: ControlledLoop, worker: ModelWorker, forward_stream: ForwardStream, tp_rank: int,
                 allow_pickled_weight_updates: bool) -> None:
        self.loop = loop
        self.worker = worker
        self.forward_stream = forward_stream
        self.tp_rank = tp_rank
        self.allow_pickled_weight_updates = allow_pickled_weight_updates
        self.paused = False
        self.pause_mode: Optional[str] = None
        self.released: Set[str] = set()
        self._handlers: Dict[type, Callable[[Any], Any]] = {
            PauseGenerationReqInput: self.pause_generation,
            ContinueGenerationReqInput: self.continue_generation,
            UpdateWeightFromDiskReqInput: self.update_weights_from_disk,
            UpdateWeightsFromTensorReqInput: self.update_weights_from_tensor,
            GetWeightsByNameReqInput: self.get_weights_by_name,
            ReleaseMemoryOccupationReqInput: self.release_memory_occupation,
            ResumeMemoryOccupationReqInput: self.resume_memory_occupation,
            InitWeightsUpdateGroupReqInput: self.init_weights_update_group,
            DestroyWeightsUpdateGroupReqInput: self.destroy_weights_update_group,
            UpdateWeightsFromDistributedReqInput: self.update_weights_from_distributed,
            LoadLoRAAdapterReqInput: self.load_lora_adapter,
            UnloadLoRAAdapterReqInput: self.unload_lora_adapter,
        }

    def handler(self, msg: Any) -> Optional[Callable[[Any], Any]]:
        return self._handlers.get(type(msg))

    def blocks_scheduling(self) -> bool:
        return self.paused or not FORWARD_TAGS.isdisjoint(self.released)

    # ------------------------------------------------------------------ pause / continue
    def pause_generation(self, req: PauseGenerationReqInput) -> PauseGenerationReqOutput:
        if req.mode not in PAUSE_MODES:
            return PauseGenerationReqOutput(False, f"pause mode {req.mode!r} is not one of {', '.join(PAUSE_MODES)}")
        self.loop.settle()
        self.paused, self.pause_mode = True, req.mode
        num = self.loop.live_requests()
        if req.mode == "retract":
            self.loop.retract_all()
        logger.info("Generation paused (%s): %d running request(s), %d waiting", req.mode, num,
                    self.loop.num_waiting())
        return PauseGenerationReqOutput(True, f"Generation paused ({req.mode}).", num_paused_requests=num)

    def continue_generation(self, req: ContinueGenerationReqInput) -> ContinueGenerationReqOutput:
        was_paused, self.paused, self.pause_mode = self.paused, False, None
        if req.torch_empty_cache:
            self._empty_device_cache()
        if was_paused:
            logger.info("Generation continued")
        message = "Generation continued." if was_paused else "Generation was not paused."
        return ContinueGenerationReqOutput(True, message)

    # ------------------------------------------------------------------ weights
    def update_weights_from_disk(self, req: UpdateWeightFromDiskReqInput) -> UpdateWeightFromDiskReqOutput:
        refused = self._refuse_weight_change(req.flush_cache)
        if refused is not None:
            return UpdateWeightFromDiskReqOutput(False, refused)
        ok, message = self._on_model_thread(lambda: self.worker.update_weights_from_disk(req.model_path,
                                                                                            req.load_format))
        ok, message = self._agree(ok, message)
        if ok and req.flush_cache:
            self.loop.flush_kv()
        return UpdateWeightFromDiskReqOutput(ok, message)

    def update_weights_from_tensor(self, req: UpdateWeightsFromTensorReqInput) -> UpdateWeightsFromTensorReqOutput:
        refused = self._refuse_weight_change(req.flush_cache)
        payloads, tp_size = req.serialized_named_tensors, get_tp_size()
        if refused is None and len(payloads) not in (1, tp_size):
            refused = (f"serialized_named_tensors has {len(payloads)} entries: give one per tensor-parallel rank "
                       f"({tp_size}) or one for all.")
        if refused is not None:
            return UpdateWeightsFromTensorReqOutput(False, refused)
        tp_rank = self.tp_rank
        data = payloads[tp_rank if len(payloads) > 1 else 0]
        allow_pickle = self.allow_pickled_weight_updates

        def load() -> Tuple[bool, str]:
            # Decoded where the forwards run: a pickled payload's CUDA handles open on this device.
            try:
                named = decode_payload(data, tp_rank, allow_pickle, req.load_format)
            except PayloadError as e:
                return False, str(e)
            return self.worker.update_weights_from_tensor(named)

        ok, message = self._agree(*self._on_model_thread(load))
        if ok and req.flush_cache:
            self.loop.flush_kv()
        return UpdateWeightsFromTensorReqOutput(ok, message)

    # ------------------------------------------------------------------ weight update groups
    def init_weights_update_group(self, req: InitWeightsUpdateGroupReqInput) -> InitWeightsUpdateGroupReqOutput:
        # Blocks this rank until the trainer and every other rank joined (or the timeout).
        ok, message = self._on_model_thread(lambda: self.worker.init_weights_update_group(
            req.master_address, req.master_port, req.rank_offset, req.world_size, req.group_name, req.backend))
        if not bool(all_reduce_min_int(int(ok))) and ok:
            # Another rank failed to join: leave the group here too, so that a retry starts afresh.
            self._on_model_thread(lambda: self.worker.destroy_weights_update_group(req.group_name))
            ok, message = False, "Another tensor-parallel rank failed to join the weight update group."
        return InitWeightsUpdateGroupReqOutput(ok, message)

    def destroy_weights_update_group(self, req: DestroyWeightsUpdateGroupReqInput
                                     ) -> DestroyWeightsUpdateGroupReqOutput:
        ok, message = self._on_model_thread(lambda: self.worker.destroy_weights_update_group(req.group_name))
        return DestroyWeightsUpdateGroupReqOutput(ok, message)

    def update_weights_from_distributed(self, req: UpdateWeightsFromDistributedReqInput
                                        ) -> UpdateWeightsFromDistributedReqOutput:
        self.loop.settle()
        worker = self.worker
        unreceivable: Optional[str] = None
        if req.load_format is not None:
            unreceivable = (f"load_format {req.load_format!r} is not supported: broadcast the tensors one by one "
                            "(load_format null).")
        unreceivable = unreceivable or worker.check_distributed_update(req.group_name, req.names, req.dtypes,
                                                                       req.shapes)
        # Every rank receives or none does (a broadcast missing one rank would hang the others).
        if not all_reduce_min_int(int(unreceivable is None)):
            message = unreceivable or "Another tensor-parallel rank cannot receive this update."
            logger.error("Weight update refused: %s", message)
            return UpdateWeightsFromDistributedReqOutput(False, message)
        # Any other refusal comes after the broadcast, so that the trainer's broadcast completes.
        refused = self._refuse_weight_change(req.flush_cache)
        ok, message = self._on_model_thread(lambda: worker.update_weights_from_distributed(
            req.group_name, req.names, req.dtypes, req.shapes, apply=refused is None))
        if ok and refused is not None:
            ok, message = False, f"{refused} The weights received were discarded."
        ok, message = self._agree(ok, message)
        if ok and req.flush_cache:
            self.loop.flush_kv()
        return UpdateWeightsFromDistributedReqOutput(ok, message)

    def get_weights_by_name(self, req: GetWeightsByNameReqInput) -> GetWeightsByNameReqOutput:
        if WEIGHTS in self.released:
            return GetWeightsByNameReqOutput(None, "The weights are released; resume_memory_occupation first.")
        if req.truncate_size < 0:
            return GetWeightsByNameReqOutput(None, "truncate_size must be >= 0.")
        # Reads only (a collective over the TP CPU group): runs on this thread on every rank.
        parameter, message = self.worker.get_weights_by_name(req.name, req.truncate_size)
        return GetWeightsByNameReqOutput(parameter, message)

    def _refuse_weight_change(self, flush_cache: bool) -> Optional[str]:
        if WEIGHTS in self.released:
            return "The weights are released; resume_memory_occupation(tags=['weights']) first."
        self.loop.settle()
        live = self.loop.live_requests()
        if flush_cache and live:
            return (f"Cannot update the weights while {live} request(s) hold KV cache computed with the current "
                    "weights: let them finish, abort them (abort_all_requests), pause with mode 'retract', or "
                    "send flush_cache false.")
        return None

    def _agree(self, ok: bool, message: str) -> Tuple[bool, str]:
        """Succeed only if every TP rank did; ranks that loaded roll back otherwise (a rank that
        failed left its weights as they were)."""
        all_ok = bool(all_reduce_min_int(int(ok)))
        if ok and not all_ok:
            ok = False
            undone = self._on_model_thread(self.worker.rollback_weights)
            message = f"Another tensor-parallel rank failed to update its weights. {undone}"
        elif ok:
            self.worker.commit_weights()
        if not ok:
            logger.error("Weight update failed: %s", message)
        return ok, message

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora_adapter(self, req: LoadLoRAAdapterReqInput) -> LoadLoRAAdapterReqOutput:
        """Every rank reads its shards (on the model thread, where the pool is used); if one fails,
        the others unload again, so the ranks always serve the same adapters."""
        ok, message = self._on_model_thread(
            lambda: self.worker.load_lora_adapter(req.lora_name, req.lora_path, req.pinned))
        if not bool(all_reduce_min_int(int(ok))) and ok:
            self._on_model_thread(lambda: self.worker.unload_lora_adapter(req.lora_name))
            ok, message = False, "Another tensor-parallel rank failed to load the LoRA adapter."
        return LoadLoRAAdapterReqOutput(ok, message, loaded_adapters=self.worker.loaded_lora_adapters())

    def unload_lora_adapter(self, req: UnloadLoRAAdapterReqInput) -> UnloadLoRAAdapterReqOutput:
        """Refused while requests use the adapter (the TokenizerManager waits for its own first);
        the forward in flight is settled, so no batch reads the adapter once it is gone."""
        uid = self.worker.lora_uid(req.lora_name)
        if uid is None:
            return UnloadLoRAAdapterReqOutput(False, f"LoRA adapter {req.lora_name!r} is not loaded.",
                                              loaded_adapters=self.worker.loaded_lora_adapters())
        self.loop.settle()
        users = self.loop.requests_using_lora(uid)
        if users:
            return UnloadLoRAAdapterReqOutput(False, f"LoRA adapter {req.lora_name!r} is used by {users} "
                                              "request(s); unload it when they finished.",
                                              loaded_adapters=self.worker.loaded_lora_adapters())
        ok, message = self._on_model_thread(lambda: self.worker.unload_lora_adapter(req.lora_name))
        return UnloadLoRAAdapterReqOutput(ok, message, loaded_adapters=self.worker.loaded_lora_adapters())

    # ------------------------------------------------------------------ memory
    def release_memory_occupation(self, req: ReleaseMemoryOccupationReqInput) -> ReleaseMemoryOccupationReqOutput:
        tags, error = self._tags(req.tags)
        if error is None:
            self.loop.settle()
            live = self.loop.live_requests()
            if live:
                error = (f"Cannot release memory while {live} request(s) are running: let them finish, abort "
                         "them, or pause generation with mode 'retract' first.")
        if error is not None:
            return ReleaseMemoryOccupationReqOutput(False, error)
        new = [t for t in tags if t not in self.released]
        if "kv_cache" in new:
            self.loop.flush_kv()  # the cached KV is about to be gone
        self._on_model_thread(lambda: self.worker.release_memory_occupation(new))
        self.released.update(new)
        done = ", ".join(new) if new else "nothing (already released)"
        return ReleaseMemoryOccupationReqOutput(True, f"Released {done}.")

    def resume_memory_occupation(self, req: ResumeMemoryOccupationReqInput) -> ResumeMemoryOccupationReqOutput:
        tags, error = self._tags(req.tags)
        if error is not None:
            return ResumeMemoryOccupationReqOutput(False, error)
        back = [t for t in tags if t in self.released]
        self.loop.settle()
        self._on_model_thread(lambda: self.worker.resume_memory_occupation(back))
        self.released.difference_update(back)
        done = ", ".join(back) if back else "nothing (not released)"
        return ResumeMemoryOccupationReqOutput(True, f"Resumed {done}.")

    @staticmethod
    def _tags(tags: Optional[List[str]]) -> tuple:
        error = check_tags(tags)
        return (list(tags) if tags else list(MEMORY_TAGS)), error

    # ------------------------------------------------------------------ helpers
    def _on_model_thread(self, fn: Callable[[], Any]) -> Any:
        stream = self.forward_stream
        return fn() if stream.is_cuda else stream.call(fn)

    def _empty_device_cache(self) -> None:
        if self.forward_stream.is_cuda:
            import torch

            torch.cuda.empty_cache()
