"""gpt-oss (GptOssForCausalLM): sliding-window and full layers alternating (`layer_types`), attention
with biases and a learned sink logit per head (RadixAttention's sinks: the softmax's denominator only),
and a mixture-of-experts MLP of its own kind: a biased router whose top-k logits are softmaxed, experts
with biases whose gate and up halves are interleaved in one projection (even columns gate, odd ones up)
and a clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate).

The experts run through the fused MoE machinery (layers/moe/: fused_moe_native on the CPU, the Triton
kernel on a GPU) with their biases and their own activation (ClampedSwiGLU), in FusedMoE's layout: the
checkpoint's gate_up [E, H, 2I] and down [E, I, H] are held transposed, [E, 2I, H] and [E, H, I]. Under
tensor parallelism they follow --ep-size as FusedMoE does (distributed/parallel_state.py ExpertLayout): each
block of tp_size / ep_size ranks holds E / ep_size experts, each with its intermediate dimension split over
the block's ranks (whole gate/up pairs: the interleaved columns 2i, 2i + 1 stay together); the down bias is
added by the block's first rank; the ranks' partial outputs are summed by one all-reduce. The attention's
sinks are split with its heads.

The published checkpoints hold the experts in MXFP4 (`quantization_config.quant_method` "mxfp4"): per
expert projection a `*_blocks` tensor [E, rows, cols / 32, 16] of 4-bit e2m1 codes (two per byte, the
low nibble first) and a `*_scales` tensor [E, rows, cols / 32] of e8m0 exponents (2^(s - 127)) for each
block of 32 (layers/mxfp4.py). On the CPU they stay packed as loaded, 4.25 bits per weight, and every
expert product runs the native MXFP4 kernel (csrc/linear_mxfp4.c), which decodes the codes in registers
(`keeps_mxfp4` says when: the kernel library built, this rank's sizes in whole blocks of 32). On a GPU,
and where the CPU kernel is missing, they are dequantized while loading into the model's dtype (the
experts then take four times their MXFP4 bytes in bf16); every other weight of such a checkpoint is bf16
already.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from engine.distributed.parallel_state import get_expert_layout, get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import QKVParallelLinear, RowParallelLinear
from engine.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from engine.layers.moe.fused_moe_native import ClampedSwiGLU, fused_moe_grouped, fused_moe_native
from engine.layers.mxfp4 import MXFP4_BLOCK, check_mxfp4, dequantize_mxfp4, mxfp4_kernel_available, mxfp4_linear
from engine.layers.pooler import EmbeddingPoolerOutput
from engine.layers.radix_attention import RadixAttention
from engine.layers.rotary_embedding import get_rope
from engine.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from engine.model_loader.weight_utils import ShardId, WeightLoader, load_weights_into, set_weight_loader
from engine.models.llama import STACKED_PARAMS

if TYPE_CHECKING:
    from engine.configs.model_config import ModelConfig
    from engine.model_executor.forward_batch_info import ForwardBatch

MAX_EXPERTS = 1024


class GptOssExperts(nn.Module):
    """This rank's stacked experts in FusedMoE's layout (layers/moe/): w13_weight [E, 2I, H] (gate_up, its
    rows interleaved as the checkpoint's columns: gate at even rows, up at odd ones), w2_weight [E, H, I],
    each with a bias (E and I this rank's parts; see the module doc); the checkpoint's [E, H, 2I] and
    [E, I, H] are transposed while loading. With `mxfp4` (an MXFP4 checkpoint served on the CPU by the
    native kernel) the experts stay packed instead: w13_blocks / w13_scales and w2_blocks / w2_scales as
    the checkpoint holds them (layers/mxfp4.py)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, alpha: float, limit: float,
                 mxfp4: bool = False) -> None:
        super().__init__()
        layout = get_expert_layout()
        if num_experts % layout.ep_size or intermediate % layout.moe_tp_size:
            raise ValueError(f"gpt-oss: {num_experts} experts of intermediate size {intermediate} cannot be split "
                             f"over --ep-size {layout.ep_size} and --tp-size / --ep-size {layout.moe_tp_size}")
        self.num_experts = num_experts
        self.num_local = num_experts // layout.ep_size
        self.expert_start = layout.ep_rank * self.num_local
        self.inter = intermediate // layout.moe_tp_size
        self.inter_start = layout.moe_tp_rank * self.inter
        self.adds_down_bias = layout.moe_tp_rank == 0
        self.activation = ClampedSwiGLU(alpha, limit)
        self.mxfp4 = mxfp4
        self.w13_weight_bias = nn.Parameter(torch.empty(self.num_local, 2 * self.inter), requires_grad=False)
        self.w2_weight_bias = nn.Parameter(torch.empty(self.num_local, hidden), requires_grad=False)
        set_weight_loader(self.w13_weight_bias, self._loader(1, 2, transpose=False))
        set_weight_loader(self.w2_weight_bias, self._loader(None, 0, transpose=False))
        if mxfp4:
            groups, inter_groups = hidden // MXFP4_BLOCK, self.inter // MXFP4_BLOCK
            half = MXFP4_BLOCK // 2
            self.w13_blocks = _uint8_param(self.num_local, 2 * self.inter, groups, half)
            self.w13_scales = _uint8_param(self.num_local, 2 * self.inter, groups)
            self.w2_blocks = _uint8_param(self.num_local, hidden, inter_groups, half)
            self.w2_scales = _uint8_param(self.num_local, hidden, inter_groups)
            # The checkpoint's rows are outputs, its groups inputs: gate_up split by rows (whole pairs),
            # down by groups of 32 inputs (this rank's intermediate slice).
            for param in (self.w13_blocks, self.w13_scales):
                set_weight_loader(param, self._loader(1, 2, transpose=False))
            for param in (self.w2_blocks, self.w2_scales):
                set_weight_loader(param, self._loader(2, 1, transpose=False, unit=MXFP4_BLOCK))
        else:
            self.w13_weight = nn.Parameter(torch.empty(self.num_local, 2 * self.inter, hidden), requires_grad=False)
            self.w2_weight = nn.Parameter(torch.empty(self.num_local, hidden, self.inter), requires_grad=False)
            set_weight_loader(self.w13_weight, self._loader(2, 2, transpose=True))
            set_weight_loader(self.w2_weight, self._loader(1, 1, transpose=True))

    def _loader(self, dim: Optional[int], width: int, transpose: bool, unit: int = 1) -> WeightLoader:
        """The checkpoint's [E, ...] tensor: this rank's experts, then along `dim` its intermediate part
        (`width` entries per intermediate unit, `unit` units per entry), transposed into our layout."""

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            if loaded.shape[0] != self.num_experts:
                raise ValueError(f"gpt-oss experts: the checkpoint holds {loaded.shape[0]} experts, the config "
                                 f"{self.num_experts}")
            part = loaded.narrow(0, self.expert_start, self.num_local)
            if dim is not None:
                part = part.narrow(dim, width * self.inter_start // unit, width * self.inter // unit)
            elif not self.adds_down_bias:  # the down bias: once per expert, by its block's first rank
                part = torch.zeros_like(part)
            if transpose:
                part = part.transpose(1, 2)
            if part.shape != param.shape:
                raise ValueError(f"gpt-oss experts: shape mismatch, parameter {tuple(param.shape)} vs checkpoint "
                                 f"part {tuple(part.shape)}")
            param.data.copy_(part)

        return load

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], expert_ids / weights [T, k] -> [T, H] (this rank's part of the sum); summed in float32."""
        if self.num_local != self.num_experts:  # other ranks' experts: -1, skipped
            local = expert_ids - self.expert_start
            expert_ids = torch.where((local >= 0) & (local < self.num_local), local, -1)
        if self.mxfp4:
            w13_blocks, w13_scales, w13_bias = self.w13_blocks, self.w13_scales, self.w13_weight_bias
            w2_blocks, w2_scales, w2_bias = self.w2_blocks, self.w2_scales, self.w2_weight_bias
            return fused_moe_grouped(x, self.num_local, w2_bias.shape[1],
                                     lambda rows, e: mxfp4_linear(rows, w13_blocks[e], w13_scales[e], w13_bias[e]),
                                     lambda rows, e: mxfp4_linear(rows, w2_blocks[e], w2_scales[e], w2_bias[e]),
                                     weights, expert_ids, self.activation)
        if x.is_cuda:
            from engine.layers.moe.fused_moe_triton import fused_moe_triton

            return fused_moe_triton(x, self.w13_weight, self.w2_weight, weights, expert_ids,
                                    w13_bias=self.w13_weight_bias, w2_bias=self.w2_weight_bias,
                                    activation=self.activation)
        return fused_moe_native(x, self.w13_weight, self.w2_weight, weights, expert_ids, self.w13_weight_bias,
                                self.w2_weight_bias, self.activation)

    def expert_bytes(self) -> int:
        """Bytes held by this rank's expert weights (biases excluded)."""
        if self.mxfp4:
            return sum(t.nbytes for t in (self.w13_blocks, self.w13_scales, self.w2_blocks, self.w2_scales))
        return self.w13_weight.nbytes + self.w2_weight.nbytes


def _uint8_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)


class GptOssMoE(nn.Module):
    def __init__(self, config: "ModelConfig", mxfp4: bool = False) -> None:
        super().__init__()
        raw = config.raw_config
        num_experts = int(raw["num_local_experts"])
        self.top_k = int(raw["num_experts_per_tok"])
        if not 1 <= num_experts <= MAX_EXPERTS or not 1 <= self.top_k <= num_experts:
            raise ValueError(f"gpt-oss: num_local_experts {num_experts} must be in 1..{MAX_EXPERTS} and "
                             f"num_experts_per_tok {self.top_k} in 1..num_local_experts")
        self.router = nn.Linear(config.hidden_size, num_experts, bias=True)
        self.router.requires_grad_(False)
        self.experts = GptOssExperts(num_experts, config.hidden_size, config.intermediate_size,
                                     float(raw.get("swiglu_alpha", 1.702)), float(raw.get("swiglu_limit", 7.0)), mxfp4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_logits, expert_ids = torch.topk(self.router(x), self.top_k, dim=-1)
        # The softmax is over the chosen experts' logits only (renormalised by construction).
        weights = torch.softmax(top_logits, dim=-1, dtype=top_logits.dtype)
        out = self.experts(x, expert_ids, weights)
        return tensor_model_parallel_all_reduce(out) if get_tp_size() > 1 else out


class GptOssAttention(nn.Module):
    def __init__(self, config: "ModelConfig", layer_id: int) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=True)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=True)
        self.rotary_emb = get_rope(self.head_dim, self.head_dim, config.context_len, config.rope_theta,
                                   config.rope_scaling)
        self.attn = RadixAttention(self.qkv_proj.num_heads, self.head_dim, self.head_dim**-0.5,
                                   self.qkv_proj.num_kv_heads, layer_id,
                                   sliding_window_size=config.layer_windows[layer_id], with_sinks=True)
        assert self.attn.sinks is not None  # with_sinks
        heads, first = self.qkv_proj.num_heads, get_tp_rank() * self.qkv_proj.num_heads

        def load_sinks(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            if loaded.shape != (heads * get_tp_size(),):
                raise ValueError(f"gpt-oss sinks: expected {heads * get_tp_size()} values, got {tuple(loaded.shape)}")
            param.data.copy_(loaded.narrow(0, first, heads))

        set_weight_loader(self.attn.sinks, load_sinks)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: "ForwardBatch",
                last_rows_only: bool = False) -> torch.Tensor:
        """last_rows_only: as LlamaAttention.forward (each request's last row of an extend alone)."""
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k, inplace=True)  # slices of the qkv output, ours to change
        return self.o_proj(self.attn(q, k, v, forward_batch, last_rows_only=last_rows_only))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config: "ModelConfig", layer_id: int, mxfp4: bool = False) -> None:
        super().__init__()
        self.self_attn = GptOssAttention(config, layer_id)
        self.mlp = GptOssMoE(config, mxfp4)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: "ForwardBatch",
                residual: Optional[torch.Tensor], last_rows_only: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """last_rows_only: as LlamaDecoderLayer.forward (every row's K/V stored, the rest of the layer, its
        experts included, on each request's last row)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, forward_batch, last_rows_only)
        if last_rows_only:
            residual = residual.index_select(0, forward_batch.last_positions())
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class GptOssModel(nn.Module):
    def __init__(self, config: "ModelConfig", mxfp4: bool = False) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        layers = [GptOssDecoderLayer(config, i, mxfp4) for i in range(config.num_hidden_layers)]
        self.layers = nn.ModuleList(layers)
        self.decoder_layers: List[GptOssDecoderLayer] = layers
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: "ForwardBatch",
                last_rows_only: bool = False) -> torch.Tensor:
        """last_rows_only: of an extend batch, return each request's last row only."""
        hidden_states = self.embed_tokens(input_ids)
        residual: Optional[torch.Tensor] = None
        last = len(self.decoder_layers) - 1
        for i, layer in enumerate(self.decoder_layers):
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual,
                                            last_rows_only and i == last)
        if residual is None:  # no layers
            if last_rows_only:
                hidden_states = hidden_states.index_select(0, forward_batch.last_positions())
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class GptOssForCausalLM(nn.Module):
    def __init__(self, config: "ModelConfig") -> None:
        super().__init__()
        if not config.layer_windows:
            raise ValueError("a gpt-oss config needs its layers' windows (ModelConfig.layer_windows)")
        self.config = config
        self.keeps_mxfp4 = keeps_mxfp4(config)
        self.model = GptOssModel(config, self.keeps_mxfp4)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: "ForwardBatch",
                get_embedding: bool = False) -> Union[LogitsProcessorOutput, EmbeddingPoolerOutput]:
        if get_embedding:
            raise ValueError("gpt-oss is served for generation only")
        last_rows_only = self.logits_processor.last_rows_suffice(forward_batch)
        hidden_states = self.model(input_ids, positions, forward_batch, last_rows_only)
        return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch, pruned=last_rows_only)

    stacked_params: Sequence[Tuple[str, str, ShardId]] = STACKED_PARAMS

    def weight_skip_substrings(self) -> List[str]:
        skip = ["rotary_emb.inv_freq"]
        if self.config.tie_word_embeddings:
            skip.append("lm_head.weight")
        return skip

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]], require_all: bool = True) -> None:
        load_weights_into(self, _renamed(weights, self.keeps_mxfp4), self.stacked_params, skip_substrings=self.weight_skip_substrings(),
                          require_all=require_all)


def keeps_mxfp4(config: "ModelConfig") -> bool:
    """Whether this model keeps an MXFP4 checkpoint's experts packed: on the CPU where the native kernel is
    built, with this rank's hidden and intermediate sizes in whole blocks of 32 (the down projection's
    blocks run along the intermediate dimension). Elsewhere (a GPU: no MXFP4 kernel of ours there) they
    are dequantized while loading."""
    quantization = config.raw_config.get("quantization_config")
    if not isinstance(quantization, dict) or str(quantization.get("quant_method", "")).lower() != "mxfp4":
        return False
    inter = config.intermediate_size // get_expert_layout().moe_tp_size
    return (torch.get_default_device().type == "cpu" and mxfp4_kernel_available()
            and config.hidden_size % MXFP4_BLOCK == 0 and inter % MXFP4_BLOCK == 0)


# The checkpoint's expert tensors -> ours (FusedMoE's names: w13 gate_up, w2 down).
_EXPERT_NAMES = {"gate_up_proj": "w13_weight", "gate_up_proj_bias": "w13_weight_bias", "down_proj": "w2_weight",
                 "down_proj_bias": "w2_weight_bias"}
_PACKED_NAMES = {"gate_up_proj": "w13", "down_proj": "w2"}


def _expert_name(name: str, names: Dict[str, str], suffix: str = "") -> str:
    module, _, leaf = name.rpartition(".")
    if module.endswith(".experts") and leaf in names:
        return f"{module}.{names[leaf]}{suffix}"
    return name


def _renamed(weights: Iterable[Tuple[str, torch.Tensor]], keep_mxfp4: bool) -> Iterable[Tuple[str, torch.Tensor]]:
    """The checkpoint's names onto ours: the sinks belong to the attention layer (self_attn.attn.sinks), the
    experts' tensors take FusedMoE's names; an MXFP4 expert projection's blocks and scales (in either order)
    become its dequantized weight, or with keep_mxfp4 its packed pair (w13_blocks, w13_scales, ...)."""
    pending: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        if name.endswith(("_blocks", "_scales")):
            base, _, part = name.rpartition("_")
            parts = pending.setdefault(base, {})
            parts[part] = tensor
            if len(parts) == 2:
                del pending[base]
                try:
                    if keep_mxfp4:
                        check_mxfp4(parts["blocks"], parts["scales"])
                        for kind in ("blocks", "scales"):
                            yield _expert_name(base, _PACKED_NAMES, "_" + kind), parts[kind]
                    else:
                        yield _expert_name(base, _EXPERT_NAMES), dequantize_mxfp4(parts["blocks"], parts["scales"])
                except ValueError as e:
                    raise ValueError(f"gpt-oss checkpoint weight {base}: {e}") from None
            continue
        if name.endswith(".self_attn.sinks"):
            name = name[: -len("sinks")] + "attn.sinks"
        yield _expert_name(name, _EXPERT_NAMES), tensor
    if pending:
        base = next(iter(pending))
        raise ValueError(f"gpt-oss checkpoint weight {base}: MXFP4 {'blocks' if 'blocks' in pending[base] else 'scales'} "
                         "without their " + ("scales" if "blocks" in pending[base] else "blocks"))
