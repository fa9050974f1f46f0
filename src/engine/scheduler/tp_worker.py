"""TpModelWorker: the scheduler's handle on the model of one tensor-parallel rank."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

import torch

from engine.configs.mla_config import mla_dims_of
from engine.configs.pooling_config import PoolingType
from engine.distributed.weight_update_group import WeightUpdateGroups, tensor_specs
from engine.scheduler.overlap_utils import resolve_relay_input_ids, write_relay
from engine.lora.lora_config import LoRAError
from engine.layers.logits_processor import LogitsProcessorOutput
from engine.model_executor.forward_batch_info import ForwardBatch, ModelWorkerBatch

if TYPE_CHECKING:
    from engine.layers.moe.expert_distribution import ExpertDistributionRecorder
    from engine.lora.lora_manager import LoRAManager
    from engine.model_executor.model_runner import ModelRunner
    from engine.model_executor.simulated_device import SimulatedModelRunner
    from engine.models.sparse_moe import MoeForCausalLM
    from engine.server_args import ServerArgs

logger = logging.getLogger(__name__)

_SIMULATED_NO_WEIGHTS = "the simulated device (--simulated-device-forward-ms) has no model weights"


@dataclass
class GenerationBatchResult:
    logits_output: Any  # LogitsProcessorOutput (or None for a fake worker without logprobs)
    next_token_ids: Optional[torch.Tensor]  # [bs] int64; None until a delayed sampling ran
    # Kept by a forward whose sampling is delayed (delay_sample=True) for sample_delayed().
    forward_batch: Optional[ForwardBatch] = None


@dataclass
class EmbeddingBatchResult:
    # One float32 vector per request, on the CPU: [bs, dim], or a list when the requests kept
    # different `dimensions`.
    embeddings: Union[torch.Tensor, List[torch.Tensor]]
    # Nothing was sampled: the forward stream copies next_token_ids only when there are some.
    next_token_ids: Optional[torch.Tensor] = None


def embedding_info(model_config: Any, max_total_num_tokens: int) -> Dict[str, Any]:
    """What the scheduler and the TokenizerManager need to know about an embedding model."""
    if model_config.is_generation:
        return {"is_generation": True}
    pooling = model_config.pooling
    return {
        "is_generation": False,
        # An embedding input needs no room for output tokens: the whole context is usable.
        "max_req_input_len": min(model_config.context_len, max_total_num_tokens),
        "embedding_dim": model_config.hidden_size,
        "is_matryoshka": model_config.is_matryoshka,
        "matryoshka_dimensions": model_config.matryoshka_dimensions,
        # Whether K/V computed by an earlier forward (a cached prefix, an earlier chunk) may stand
        # in for recomputing them: those tokens are then left out of the pooled forward, which
        # only last-token pooling of a causal model can afford (an encoder's K/V depend on the
        # whole input, mean pooling needs every token's hidden state).
        "embedding_kv_reusable": (not model_config.is_encoder_only and pooling is not None
                                  and pooling.pooling_type == PoolingType.LAST),
    }


def worker_limits(max_total_num_tokens: int, context_len: int, req_pool_size: int,
                  max_running_requests: Optional[int], vocab_size: int, page_size: int,
                  device: str, total_kv_heads: int = 0) -> Dict[str, Any]:
    """The limits the scheduler admits requests under (SGLang's rules)."""
    max_req_len = min(context_len - 1, max_total_num_tokens - 1)
    return {
        "max_total_num_tokens": max_total_num_tokens,
        "max_running_requests": min(max_running_requests or req_pool_size, req_pool_size),
        "max_req_len": max_req_len,
        "max_req_input_len": max_req_len - 5,
        "context_len": context_len,
        "vocab_size": vocab_size,
        "page_size": page_size,
        "device": device,
        "total_kv_heads": total_kv_heads,  # the model's KV heads over all TP ranks (0: unknown)
    }


class TpModelWorker:
    def __init__(self, server_args: ServerArgs, gpu_id: int = 0, tp_rank: int = 0) -> None:
        from engine.configs.model_config import ModelConfig

        self.server_args = server_args
        self.tp_rank = tp_rank
        assert server_args.model_path is not None  # resolved before any worker is built (resolve_model_path)
        self.model_config = ModelConfig.from_pretrained(
            server_args.model_path, dtype=server_args.dtype, context_length=server_args.context_length,
            device=server_args.device, is_embedding=server_args.is_embedding,
        )
        if server_args.simulated_device_cost() is not None:
            # Benchmarks and tests of the host side: a forward that sleeps and deterministic tokens.
            from engine.model_executor.simulated_device import SimulatedModelRunner

            self.model_runner: Union[ModelRunner, SimulatedModelRunner] = SimulatedModelRunner(
                self.model_config, server_args)
            # No model: the embedding forward and the control plane's weight and memory calls refuse.
            self.real_runner: Optional[ModelRunner] = None
        else:
            from engine.model_executor.model_runner import ModelRunner

            self.model_runner = self.real_runner = ModelRunner(
                self.model_config, server_args, tp_rank=tp_rank, tp_size=server_args.tp_size, gpu_id=gpu_id
            )
        self.device = self.model_runner.device
        # Groups with RL trainers that broadcast new weights (init_weights_update_group).
        self.update_groups = WeightUpdateGroups(tp_rank, torch.device(self.device),
                                                timedelta(seconds=server_args.dist_timeout))
        # The most bytes one update_weights_from_distributed may broadcast: the full model in
        # float32 (this rank's parameters times the TP size, at 4 bytes an element) plus slack.
        local_numel = 0 if self.real_runner is None else sum(p.numel() for p in self.real_runner.model.parameters())
        self.max_distributed_update_bytes = 4 * local_numel * server_args.tp_size + (64 << 20)
        self.req_to_token_pool = self.model_runner.req_to_token_pool
        self.token_to_kv_pool_allocator = self.model_runner.token_to_kv_pool_allocator
        # The overlap relay: last sampled token per request-pool row (overlap_utils.py).
        self.output_tokens_buf = torch.zeros(self.req_to_token_pool.size + 1, dtype=torch.int64,
                                             device=self.device)

    def make_draft_runner(self, model_path: str, eagle_draft: bool = False) -> ModelRunner:
        """The speculative draft model beside this worker's model (speculative/draft_model.py): the
        same device and dtype, the target's context length, its slots shared. `eagle_draft`: an EAGLE
        head, where a DeepSeek-V3 checkpoint stands for its MTP layer (ModelConfig.from_pretrained)."""
        from engine.configs.model_config import ModelConfig
        from engine.model_executor.model_runner import ModelRunner

        if self.real_runner is None:
            raise ValueError("a draft model needs a real target model (not --simulated-device-forward-ms)")
        target = self.model_config
        config = ModelConfig.from_pretrained(
            model_path, dtype=str(target.dtype).removeprefix("torch."), context_length=target.context_len,
            device=self.server_args.device, eagle_draft=eagle_draft)
        if config.vocab_size != target.vocab_size:
            raise ValueError(f"--speculative-draft-model-path {model_path}: its vocabulary has {config.vocab_size} "
                             f"tokens, the target's {target.vocab_size}; the draft must share the target's tokenizer")
        return ModelRunner(config, self.server_args, tp_rank=self.tp_rank, tp_size=self.server_args.tp_size,
                           gpu_id=self.real_runner.gpu_id, draft_of=self.real_runner)

    def get_worker_info(self) -> Dict[str, Any]:
        mr = self.model_runner
        info = worker_limits(
            max_total_num_tokens=mr.max_total_num_tokens,
            context_len=self.model_config.context_len,
            req_pool_size=self.req_to_token_pool.size,
            max_running_requests=mr.max_running_requests,
            vocab_size=self.model_config.vocab_size,
            page_size=self.server_args.page_size,
            device=str(self.device),
            # An MLA model's one latent "head" is replicated on every rank, not split.
            total_kv_heads=1 if mla_dims_of(self.model_config.raw_config) is not None else self.model_config.num_key_value_heads,
        )
        info.update(embedding_info(self.model_config, mr.max_total_num_tokens))
        # What /get_server_info reports of the KV pool (--kv-cache-dtype): its element type and size.
        pool = mr.token_to_kv_pool
        if pool is not None:  # None on the simulated device
            info["kv_cache_dtype"] = str(pool.dtype).removeprefix("torch.")
            info["kv_cache_bytes_per_token"] = pool.bytes_per_token()
        moe = self._moe_model()
        if moe is not None:  # what /get_server_info reports of a mixture-of-experts model
            info["moe_layout"] = moe.expert_layout(self.server_args.ep_size)
        return info

    def _moe_model(self) -> Optional["MoeForCausalLM"]:
        from engine.models.sparse_moe import MoeForCausalLM

        model = None if self.real_runner is None else self.real_runner.model
        return model if isinstance(model, MoeForCausalLM) else None

    def expert_recorder(self) -> Optional["ExpertDistributionRecorder"]:
        """The tokens-per-expert counter of a mixture-of-experts model (None for a dense one)."""
        moe = self._moe_model()
        return None if moe is None else moe.expert_recorder

    @property
    def eos_token_ids(self) -> set:
        return set(self.model_config.eos_token_ids or ())

    def forward_batch_generation(self, batch: ModelWorkerBatch, delay_sample: bool = False) -> GenerationBatchResult:
        """Forward and sample. With `delay_sample` only the forward runs: the result carries the
        logits until `sample_delayed` (the vocabulary mask of a constrained batch is known only
        after the previous step's tokens were accepted by the matchers)."""
        forward_batch = ForwardBatch.init_new(batch, self.model_runner)
        if batch.relay_rows is not None:
            forward_batch.input_ids = resolve_relay_input_ids(
                forward_batch.input_ids, batch.relay_rows.to(self.device), self.output_tokens_buf)
        logits_output = self.model_runner.forward(forward_batch)
        if delay_sample:
            return GenerationBatchResult(logits_output=logits_output, next_token_ids=None,
                                         forward_batch=forward_batch)
        return self._sample(logits_output, forward_batch)

    def forward_batch_verify(self, batch: ModelWorkerBatch) -> LogitsProcessorOutput:
        """A TARGET_VERIFY forward (engine/speculative/): the logits of every position, [tokens, vocab]
        (and the hidden states when the batch captures them)."""
        forward_batch = ForwardBatch.init_new(batch, self.model_runner)
        return self.model_runner.forward(forward_batch)

    def sample_delayed(self, result: GenerationBatchResult,
                       vocab_mask: Optional[torch.Tensor]) -> GenerationBatchResult:
        """The sampling half of a delayed forward, with this step's vocabulary mask."""
        forward_batch = result.forward_batch
        assert forward_batch is not None, "sample_delayed needs a forward run with delay_sample=True"
        if forward_batch.sampling_info is not None:
            forward_batch.sampling_info.vocab_mask = vocab_mask
        return self._sample(result.logits_output, forward_batch)

    def _sample(self, logits_output: Any, forward_batch: ForwardBatch) -> GenerationBatchResult:
        next_token_ids = self.model_runner.sample(logits_output, forward_batch)
        write_relay(self.output_tokens_buf, forward_batch.req_pool_indices, next_token_ids)
        return GenerationBatchResult(logits_output=logits_output, next_token_ids=next_token_ids)

    def forward_batch_embedding(self, batch: ModelWorkerBatch) -> EmbeddingBatchResult:
        forward_batch = ForwardBatch.init_new(batch, self.model_runner)
        assert self.real_runner is not None  # ServerArgs refuses the simulated device for embedding models
        pooled = self.real_runner.forward_embedding(forward_batch).embeddings
        # Copied here, on the forward thread: the scheduling thread only ever sees host memory.
        if isinstance(pooled, list):
            return EmbeddingBatchResult(embeddings=[row.cpu() for row in pooled])
        return EmbeddingBatchResult(embeddings=pooled.cpu())

    # ------------------------------------------------------------------ control plane
    # Called by the scheduler's SchedulerControl on every TP rank, on the thread that runs the
    # forwards (never while one runs); see model_executor/weight_update.py and memory_saver.py.
    # The simulated device (--simulated-device-forward-ms) has no weights to update or read, and
    # holds no device memory: the weight calls fail with a message, the memory calls are no-ops.
    def update_weights_from_disk(self, model_path: str, load_format: Optional[str]) -> Tuple[bool, str]:
        if self.real_runner is None:
            return False, _SIMULATED_NO_WEIGHTS
        return self.real_runner.weight_updater.update_from_disk(model_path, load_format)

    def update_weights_from_tensor(self, named_tensors: Sequence[Tuple[str, torch.Tensor]]) -> Tuple[bool, str]:
        if self.real_runner is None:
            return False, _SIMULATED_NO_WEIGHTS
        return self.real_runner.weight_updater.update_from_tensors(named_tensors)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str) -> Tuple[bool, str]:
        if self.real_runner is None:
            return False, _SIMULATED_NO_WEIGHTS
        return self.update_groups.init(master_address, master_port, rank_offset, world_size, group_name, backend)

    def destroy_weights_update_group(self, group_name: str) -> Tuple[bool, str]:
        return self.update_groups.destroy(group_name)

    def check_distributed_update(self, group_name: str, names: Sequence[str], dtypes: Sequence[str],
                                 shapes: Sequence[Sequence[int]]) -> Optional[str]:
        missing = self.update_groups.missing(group_name)
        if missing is not None:
            return missing
        specs, error = tensor_specs(names, dtypes, shapes)
        if error is not None:
            return error
        total = sum(spec.nbytes for spec in specs)
        if total > self.max_distributed_update_bytes:
            return (f"The update broadcasts {total} bytes, more than a whole model's worth "
                    f"({self.max_distributed_update_bytes}): send the weights in smaller buckets.")
        return None

    def update_weights_from_distributed(self, group_name: str, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]], apply: bool) -> Tuple[bool, str]:
        assert self.real_runner is not None  # no group exists on the simulated device (init refuses)
        specs, _ = tensor_specs(names, dtypes, shapes)  # checked by check_distributed_update
        try:
            received = self.update_groups.receive(group_name, specs)
        except Exception as e:  # noqa: BLE001 - a timeout or a trainer gone: the weights are unchanged
            logger.error("Receiving weights over group %r failed: %s", group_name, e)
            return False, f"Failed to receive the weights from the trainer: {e}. The weights are unchanged."
        if not apply:
            return True, ""
        return self.real_runner.weight_updater.update_from_tensors(received)

    # ------------------------------------------------------------------ LoRA adapters (engine/lora/)
    def _lora(self) -> "LoRAManager":
        manager = self.real_runner.lora_manager if self.real_runner is not None else None
        if manager is None:
            raise LoRAError("LoRA is not enabled on this server (start it with --enable-lora or --lora-paths).")
        return manager

    def load_lora_adapter(self, name: str, path: str, pinned: bool) -> Tuple[bool, str]:
        try:
            self._lora().load(name, path, pinned)
        except LoRAError as e:
            return False, str(e)
        return True, f"LoRA adapter {name!r} loaded."

    def unload_lora_adapter(self, name: str) -> Tuple[bool, str]:
        try:
            self._lora().unload(name)
        except LoRAError as e:
            return False, str(e)
        return True, f"LoRA adapter {name!r} unloaded."

    def lora_uid(self, name: str) -> Optional[str]:
        manager = self.real_runner.lora_manager if self.real_runner is not None else None
        return manager.uid_of(name) if manager is not None else None

    def loaded_lora_adapters(self) -> Dict[str, str]:
        manager = self.real_runner.lora_manager if self.real_runner is not None else None
        return dict(manager.loaded()) if manager is not None else {}

    def rollback_weights(self) -> str:
        return _SIMULATED_NO_WEIGHTS if self.real_runner is None else self.real_runner.weight_updater.rollback()

    def commit_weights(self) -> None:
        if self.real_runner is not None:
            self.real_runner.weight_updater.commit()

    def get_weights_by_name(self, name: str, truncate_size: int) -> Tuple[Optional[List[Any]], str]:
        if self.real_runner is None:
            return None, _SIMULATED_NO_WEIGHTS
        return self.real_runner.weight_updater.full_weight(name, truncate_size)

    def release_memory_occupation(self, tags: Iterable[str]) -> None:
        if self.real_runner is not None:
            self.real_runner.memory_saver.release(tags)

    def resume_memory_occupation(self, tags: Iterable[str]) -> None:
        if self.real_runner is not None:
            self.real_runner.memory_saver.resume(tags)

    @property
    def released_memory(self) -> Set[str]:
        return set() if self.real_runner is None else set(self.real_runner.memory_saver.released)
