"""ModelRunner: owns the model, the KV memory pools and the attention backend of one TP rank."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, List, Optional, Tuple

import torch

from engine.configs.mla_config import check_mla_server_args, mla_dims_of
from engine.configs.model_config import ModelConfig
from engine.utils.malloc_tuning import keep_large_allocations_in_heap
from engine.distributed.parallel_state import (
    all_reduce_min_int,
    assert_same_across_tp,
    get_tp_size,
    set_expert_parallel_size,
)
from engine.kernels import ops as kernel_ops
from engine.layers.attention import create_attention_backend
from engine.layers.linear import quantize_model
from engine.layers.quant_config import resolve_quantization
from engine.layers.logits_processor import LogitsProcessorOutput
from engine.layers.pooler import EmbeddingPoolerOutput
from engine.layers.vocab_parallel_embedding import quantize_lm_head
from engine.layers.radix_attention import RadixAttention
from engine.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, is_fp8, kv_cache_dtype
from engine.mem_cache.mla_pool import MLATokenToKVPool
from engine.model_executor.forward_batch_info import ForwardBatch
from engine.model_executor.memory_saver import MemorySaver
from engine.model_executor.weight_update import WeightUpdater
from engine.model_loader.loader import get_model
from engine.server_args import ONLINE_QUANTIZATION, ServerArgs

if TYPE_CHECKING:
    from engine.layers.sampler import Sampler
    from engine.lora.lora_manager import LoRAManager

logger = logging.getLogger(__name__)

# On the CPU a bigger pool only costs RAM that the rest of the machine wants back.
CPU_MAX_TOTAL_TOKENS = 1 << 18
CPU_MAX_RUNNING_REQUESTS = 1024
# Debug aid (tests): all-gather the sampled ids of every step and fail if TP ranks disagree.
CHECK_TP_SAMPLING = os.environ.get("ENGINE_CHECK_TP_SAMPLING", "0") == "1"


# KV pool sizing on CUDA: room kept for the logits of this many decode rows (when
# --max-running-requests is not given), and a fixed slack for the CUDA context's own growth.
RESERVE_LOGIT_ROWS = 512
RESERVE_SLACK_BYTES = 512 << 20


def kv_cache_budget_bytes(free_bytes: int, mem_fraction_static: float, reserve_bytes: int) -> int:
    """Bytes for the KV pool: the --mem-fraction-static share of the memory free after the
    weights, but never so much that less than `reserve_bytes` stays free for the forward."""
    return max(0, min(int(free_bytes * mem_fraction_static), free_bytes - reserve_bytes))


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        server_args: ServerArgs,
        tp_rank: int = 0,
        tp_size: int = 1,
        gpu_id: int = 0,
        draft_of: Optional["ModelRunner"] = None,
    ) -> None:
        """`draft_of`: this runner is the speculative draft model beside that target runner
        (speculative/draft_model.py): it shares the target's request-to-token rows and slot
        allocator, its KV pool has as many slots, and it captures no CUDA graphs."""
        self.model_config = model_config
        self.draft_of = draft_of
        self.server_args = server_args
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.gpu_id = gpu_id
        self.page_size = server_args.page_size
        if get_tp_size() != tp_size:
            raise RuntimeError(
                f"ModelRunner built for tp_size {tp_size} but the TP group has size {get_tp_size()}; "
                "call engine.distributed.parallel_state.init_tp_group first"
            )
        set_expert_parallel_size(server_args.ep_size)  # read by the MoE layers the model builds
        # DeepSeek-V2/V3 (MLA): a latent KV pool (mla_pool.py) that only torch_native attends over.
        self.mla_dims = mla_dims_of(model_config.raw_config)
        attention_backend = server_args.attention_backend
        assert attention_backend is not None  # ServerArgs.resolve_defaults picks one
        if self.mla_dims is not None:
            check_mla_server_args(server_args.enable_lora)
            if attention_backend != "torch_native":
                logger.warning("MLA model: attention runs on the torch_native backend instead of --attention-backend "
                               "%s (no other backend attends with K and V of different sizes)", attention_backend)
                attention_backend = "torch_native"

        if server_args.device == "cuda":
            torch.cuda.set_device(gpu_id)
            self.device = f"cuda:{gpu_id}"
        else:
            self.device = "cpu"
            keep_large_allocations_in_heap()  # CPU forwards churn through multi-MB temporaries
        self.dtype = model_config.dtype
        torch.manual_seed(server_args.random_seed)

        # A pre-quantized checkpoint (its config.json's quantization_config), checked against --quantization.
        prequantized = resolve_quantization(model_config.raw_config, server_args.quantization)
        if prequantized is not None and (server_args.enable_lora or server_args.lora_paths):
            raise ValueError(f"LoRA adapters are not supported yet with a {prequantized.method}-quantized checkpoint")
        if server_args.quantize_lm_head and prequantized is None and server_args.quantization not in ONLINE_QUANTIZATION:
            raise ValueError("--quantize-lm-head quantizes the head with --quantization w8a8_int8 or fp8, or on a 4-bit "
                             "checkpoint; this checkpoint is float and --quantization is unset")
        if prequantized is not None and server_args.quantize_lm_head and (prequantized.weights != "int4"
                                                                          or prequantized.lm_head):
            raise ValueError(f"--quantize-lm-head quantizes a float head of a float or 4-bit checkpoint; this checkpoint "
                             f"is pre-quantized ({prequantized.method}, {prequantized.weights} weights"
                             f"{', its head quantized too' if prequantized.lm_head else ''}) and its config says how "
                             f"its head is stored")
        self.model = get_model(model_config, self.device, self.dtype, prequantized)
        # --kv-cache-dtype: the pool's element type, and for fp8 the checkpoint's per-layer scales.
        self.kv_cache_dtype = kv_cache_dtype(server_args.kv_cache_dtype, self.dtype)
        self.kv_scales: Tuple[Optional[List[float]], Optional[List[float]]] = (None, None)
        if is_fp8(self.kv_cache_dtype) and not model_config.is_encoder_only:
            from engine.model_loader.kv_scales import read_kv_scales

            self.kv_scales = read_kv_scales(model_config.model_path, model_config.num_hidden_layers)
        if prequantized is None and server_args.quantization not in (None, "mxfp4"):  # mxfp4: gpt-oss loads it
            # Before packing: a quantized layer's weight is its QuantizedWeight, nothing is packed for it.
            done = quantize_model(self.model, server_args.quantization)
            logger.info("Quantized %d linear weights (%s, per output channel)", done, server_args.quantization)
            if server_args.quantize_lm_head:
                heads = quantize_lm_head(self.model, server_args.quantization)
                logger.info("Quantized the LM head (%s, per vocabulary row): %d", server_args.quantization, heads)
        if prequantized is not None and server_args.quantize_lm_head:  # a 4-bit checkpoint's float head
            heads = quantize_lm_head(self.model, "w8a8_int8")
            logger.info("Quantized the LM head (w8a8_int8, per vocabulary row) of a 4-bit checkpoint: %d", heads)
        if self.device == "cpu":
            from engine.layers.linear import prepack_linear_weights

            packed = prepack_linear_weights(self.model)
            logger.info("Packed %d linear weights for oneDNN", packed)
        # --enable-lora: the adapters, their device pool, the delta in every targeted projection.
        self.lora_manager: Optional[LoRAManager] = None
        if server_args.enable_lora:
            from engine.lora.lora_manager import LoRAManager

            self.lora_manager = LoRAManager(self.model, server_args, self.dtype, self.device)
        self._sampler: Optional[Sampler] = None
        if model_config.is_encoder_only and attention_backend == "flashinfer":
            raise ValueError("the flashinfer attention backend has no encoder (non-causal) attention; use "
                             "--attention-backend triton or torch_native for this model")
        if attention_backend == "flashinfer" and any(
                isinstance(m, RadixAttention) and not m.is_plain for m in self.model.modules()):
            # Our flashinfer wrapper computes plain full attention: a window would be silently ignored.
            raise ValueError("the flashinfer attention backend has no sliding-window, soft-capped or sink attention; "
                             "use --attention-backend triton or torch_native for this model")
        self.init_memory_pool()
        self.attn_backend = create_attention_backend(attention_backend, self)
        # After the backend (graphs capture through it) and after the KV pool (they index it).
        from engine.model_executor.cuda_graph_runner import maybe_create_cuda_graph_runner

        # An embedding model never decodes, and graphs only capture decode batches.
        self.cuda_graph_runner = (maybe_create_cuda_graph_runner(self)
                                  if model_config.is_generation and draft_of is None else None)
        # The control plane's hands on this rank's model: weight updates and memory release.
        self.weight_updater = WeightUpdater(self.model, model_config, self.device)
        self.memory_saver = MemorySaver(self.model, self.token_to_kv_pool, self.device,
                                        recapture_graphs=self._capture_cuda_graphs, drop_graphs=self._drop_cuda_graphs)

    def _capture_cuda_graphs(self) -> None:
        from engine.model_executor.cuda_graph_runner import maybe_create_cuda_graph_runner

        if self.model_config.is_generation:
            self.cuda_graph_runner = maybe_create_cuda_graph_runner(self)

    def _drop_cuda_graphs(self) -> None:
        self.cuda_graph_runner = None

    # ------------------------------------------------------------------ memory
    def kv_bytes_per_token(self) -> int:
        element = torch.tensor([], dtype=self.kv_cache_dtype).element_size()
        if self.mla_dims is not None:  # one latent + rope key per token per layer, shared by every head
            return self.model_config.num_hidden_layers * self.mla_dims.cache_dim * element
        kv_heads = self.model_config.get_num_kv_heads(self.tp_size)
        return 2 * self.model_config.num_hidden_layers * kv_heads * self.model_config.head_dim * element

    def profile_max_num_token(self) -> int:
        """How many tokens of KV fit in the memory budget of this rank (a speculative draft
        model's pool of as many slots, and its weights loaded later, included: speculative/memory.py)."""
        from engine.speculative.memory import draft_memory

        per_token = self.kv_bytes_per_token()
        draft = draft_memory(self.server_args, self.model_config, self.tp_size)
        later_weights = 0
        if draft is not None:
            per_token += draft.bytes_per_token
            later_weights = draft.weight_bytes
        fraction = self.server_args.mem_fraction_static
        assert fraction is not None  # ServerArgs.resolve_defaults fills it in
        if self.device.startswith("cuda"):
            # Measured after the weights are loaded; blocks the loader freed count as free.
            torch.cuda.empty_cache()
            free_bytes, _ = torch.cuda.mem_get_info(self.gpu_id)
            budget = kv_cache_budget_bytes(max(0, free_bytes - later_weights), fraction,
                                           self.activation_reserve_bytes())
            return int(budget // per_token)
        import psutil

        tokens = int(max(0, psutil.virtual_memory().available - later_weights) * fraction // per_token)
        return min(tokens, CPU_MAX_TOTAL_TOKENS)

    def activation_reserve_bytes(self) -> int:
        """GPU memory the KV pool must leave for activations, logits and CUDA graphs (an estimate)."""
        cfg, args = self.model_config, self.server_args
        element = torch.tensor([], dtype=self.dtype).element_size()
        prefill_tokens = args.chunked_prefill_size if args.chunked_prefill_size and args.chunked_prefill_size > 0 \
            else args.max_prefill_tokens
        # Live at once in a layer: residual, normed input, qkv, attention output, gate_up and its
        # activation; doubled for the allocator's rounding and the temporaries of each op.
        per_token = (4 * cfg.hidden_size + 3 * cfg.intermediate_size // self.tp_size) * element * 2
        # float32 logits of a decode batch, plus the sampler's probabilities and a sorted copy.
        logit_rows = args.max_running_requests or RESERVE_LOGIT_ROWS
        logits = logit_rows * cfg.vocab_size * 4 * 3
        graphs = 0 if args.disable_cuda_graph else args.cuda_graph_max_bs * cfg.vocab_size * 4 * 2
        return prefill_tokens * per_token + logits + graphs + RESERVE_SLACK_BYTES

    def encoder_token_budget(self) -> int:
        """Tokens an encoder may have in flight. Its K/V live only during the forward, so the pool
        is a budget, not memory: two prefill batches (the one running and the next, under the
        overlap loop), each up to --max-prefill-tokens plus one input that exceeds it."""
        args = self.server_args
        if args.max_total_tokens is not None:
            return args.max_total_tokens
        return 2 * (args.max_prefill_tokens + self.model_config.context_len)

    def init_memory_pool(self) -> None:
        if self.draft_of is not None:
            self._init_draft_memory_pool(self.draft_of)
            return
        args = self.server_args
        encoder = self.model_config.is_encoder_only
        if encoder:
            total = self.encoder_token_budget()
        else:
            total = args.max_total_tokens if args.max_total_tokens is not None else self.profile_max_num_token()
        # Every TP rank must schedule against the same pool, or their decisions would diverge.
        total = all_reduce_min_int(total)
        total = (total // self.page_size) * self.page_size
        if total < 2 * self.page_size:
            raise RuntimeError(f"not enough memory for the KV cache: {total} tokens (page size {self.page_size})")
        self.max_total_num_tokens = total

        context_len = self.model_config.context_len
        if args.max_running_requests is not None:
            max_num_reqs = args.max_running_requests
        else:
            max_num_reqs = min(max(total // context_len * 512, 2048), 4096)
            if self.device == "cpu":
                max_num_reqs = min(max_num_reqs, CPU_MAX_RUNNING_REQUESTS)
        self.max_running_requests = max_num_reqs
        rows = max_num_reqs
        if args.disaggregation_mode == "decode":
            # SGLang's DecodeReqToTokenPool: requests that wait for or receive their KV hold a row
            # but no compute, so they get rows of their own beyond the running limit.
            rows += args.disaggregation_prealloc_reqs or max_num_reqs

        self.req_to_token_pool = ReqToTokenPool(rows, context_len, self.device)
        if not encoder and self._init_hybrid_swa_pool(total, rows):
            return
        self.token_to_kv_pool = self._mla_pool(total) if self.mla_dims is not None else MHATokenToKVPool(
            # An encoder stores no K/V: only the padding page exists, slots are a token budget.
            size=0 if encoder else total,
            page_size=self.page_size,
            dtype=self.kv_cache_dtype,
            head_num=self.model_config.get_num_kv_heads(self.tp_size),
            head_dim=self.model_config.head_dim,
            layer_num=self.model_config.num_hidden_layers,
            device=self.device,
            k_scales=self.kv_scales[0],
            v_scales=self.kv_scales[1],
        )
        self.token_to_kv_pool_allocator = self._make_allocator(total)
        logger.info(
            "KV cache pool: %d tokens (%.2f GB, %s, page size %d), %d request slots, context length %d",
            total,
            0.0 if encoder else total * self.kv_bytes_per_token() / 1e9,
            str(self.kv_cache_dtype).removeprefix("torch."),
            self.page_size,
            rows,
            context_len,
        )

    def _mla_pool(self, total: int) -> MHATokenToKVPool:
        assert self.mla_dims is not None  # only asked for an MLA model
        return MLATokenToKVPool(total, self.page_size, self.kv_cache_dtype, self.mla_dims.kv_lora_rank,
                                self.mla_dims.qk_rope_head_dim, self.model_config.num_hidden_layers, self.device,
                                k_scales=self.kv_scales[0])

    def _init_hybrid_swa_pool(self, total: int, rows: int) -> bool:
        """The hybrid sliding-window pool (mem_cache/swa_pool.py) where it applies; False: one pool."""
        from engine.mem_cache.swa_pool import SWAKVPool, SWATokenToKVPoolAllocator, swa_pool_size

        args, windows = self.server_args, self.model_config.layer_windows
        if not self.model_config.is_hybrid_swa or args.disable_hybrid_swa_memory:
            return False
        # Not built: the flashinfer wrapper's slot map. A draft model (STANDALONE, EAGLE) keeps its own
        # one-pool K/V under the target's full slots (_init_draft_memory_pool): the target's allocator
        # frees both with a full slot, whatever the draft's layers are.
        unsupported = (f"--attention-backend {args.attention_backend}"
                       if args.attention_backend not in ("torch_native", "triton") else None)
        if unsupported is not None:
            logger.info("Sliding-window model: one KV pool for every layer (the hybrid pool does not support %s)",
                        unsupported)
            return False
        window = max(windows)
        chunk = args.chunked_prefill_size if args.chunked_prefill_size and args.chunked_prefill_size > 0 else 0
        # The most tokens one batch extends by: a chunk (PrefillAdder charges every admitted request to
        # the chunk budget), else the prefill budget plus one prompt that exceeds it.
        max_extend = chunk if chunk else args.max_prefill_tokens + self.model_config.context_len
        # Drafts (any algorithm) hold slots of both pools for a step. Rows, not running requests: a PD
        # decode server's rows beyond them hold received KV (a window each).
        drafts = (args.speculative_num_draft_tokens or 0) if args.speculative_algorithm is not None else 0
        swa_size = swa_pool_size(total, window, rows, max_extend, cached_prefixes=not args.disable_radix_cache,
                                 draft_tokens=drafts, page_size=self.page_size)
        if swa_size >= total:
            return False  # the windows would not save anything
        windowed = [i for i, w in enumerate(windows) if w > 0]
        pool = SWAKVPool(total, swa_size, windowed, self.kv_cache_dtype, self.model_config.get_num_kv_heads(self.tp_size),
                         self.model_config.head_dim, self.model_config.num_hidden_layers, self.device,
                         k_scales=self.kv_scales[0], v_scales=self.kv_scales[1], page_size=self.page_size)
        self.token_to_kv_pool = pool
        self.token_to_kv_pool_allocator = SWATokenToKVPoolAllocator(total, swa_size, window, rows, self.dtype,
                                                                    self.device, pool, page_size=self.page_size)
        logger.info("Hybrid sliding-window KV pools: %d tokens for %d full layers, %d for %d windowed layers "
                    "(window %d, page size %d)", total, len(windows) - len(windowed), swa_size, len(windowed), window,
                    self.page_size)
        return True

    def _init_draft_memory_pool(self, target: "ModelRunner") -> None:
        """A draft model's K/V under the target's slot numbers: one owner of the slots (the
        target's allocator), so whatever frees a target slot frees the draft's K/V of it too."""
        self.max_total_num_tokens = target.max_total_num_tokens
        self.max_running_requests = target.max_running_requests
        self.req_to_token_pool = target.req_to_token_pool
        # A DeepSeek-shaped draft (or an MTP layer) stores latents, whatever the target's pool holds.
        self.token_to_kv_pool = self._mla_pool(self.max_total_num_tokens) if self.mla_dims is not None else MHATokenToKVPool(
            size=self.max_total_num_tokens,
            page_size=self.page_size,
            dtype=self.kv_cache_dtype,
            head_num=self.model_config.get_num_kv_heads(self.tp_size),
            head_dim=self.model_config.head_dim,
            layer_num=self.model_config.num_hidden_layers,
            device=self.device,
            k_scales=self.kv_scales[0],
            v_scales=self.kv_scales[1],
        )
        self.token_to_kv_pool_allocator = target.token_to_kv_pool_allocator
        # A slot's draft K/V change whenever its target K/V do, but the allocator reports releases
        # to the target's pool only: one count of releases per slot for both (kept prefix panels
        # of the CPU cascade decode are valid while it is unchanged, layers/attention/prefix_panels.py).
        self.token_to_kv_pool.slot_generation = target.token_to_kv_pool.slot_generation
        logger.info("Draft model KV cache pool: %d tokens (%.2f GB), sharing the target's slots",
                    self.max_total_num_tokens, self.max_total_num_tokens * self.kv_bytes_per_token() / 1e9)

    def _make_allocator(self, total: int) -> PagedTokenToKVPoolAllocator:
        if self.page_size == 1:
            return TokenToKVPoolAllocator(total, self.dtype, self.device, self.token_to_kv_pool)
        return PagedTokenToKVPoolAllocator(total, self.page_size, self.dtype, self.device, self.token_to_kv_pool)

    # ------------------------------------------------------------------ forward
    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        with torch.inference_mode():
            if self.lora_manager is not None:
                self.lora_manager.prepare(forward_batch)
            if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(forward_batch):
                return self.cuda_graph_runner.replay(forward_batch)
            self.attn_backend.init_forward_metadata(forward_batch)
            return self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)

    def forward_embedding(self, forward_batch: ForwardBatch) -> EmbeddingPoolerOutput:
        """The pooled embedding of every request of an EXTEND batch (embedding models)."""
        with torch.inference_mode():
            self.attn_backend.init_forward_metadata(forward_batch)
            return self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch,
                                      get_embedding=True)

    def sample(self, logits_output: LogitsProcessorOutput, forward_batch: ForwardBatch) -> torch.Tensor:
        """Next token per request: the Sampler with the batch's sampling info, argmax without one."""
        with torch.inference_mode():
            if forward_batch.sampling_info is None:
                next_ids = kernel_ops.greedy(logits_output.next_token_logits)
            else:
                if self._sampler is None:
                    from engine.layers.sampler import Sampler

                    self._sampler = Sampler()
                next_ids = self._sampler.forward(
                    logits_output,
                    forward_batch.sampling_info,
                    forward_batch.return_logprob,
                    forward_batch.top_logprobs_nums,
                    forward_batch.token_ids_logprobs,
                )
            if CHECK_TP_SAMPLING and self.tp_size > 1:
                # Ranks sample independently from identical logits and seeds; prove they agree.
                assert_same_across_tp(next_ids, "sampled token ids")
            return next_ids
