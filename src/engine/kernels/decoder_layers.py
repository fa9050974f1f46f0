"""A decode step's decoder layers in one native call (csrc/decoder_layers.c), for Llama-family models
in bfloat16 on the CPU.

LlamaModel.forward runs its layers through `DecoderLayers.run` when everything the native chain
assumes holds, and through the modules otherwise; both compute the same bits (the chain calls the
kernels the modules call, with the same arguments). What it assumes: one TP rank; every linear packed
for the bf16 kernel (engine/kernels/linear.py; a gate_up of two equal halves of whole 128-column
panel pairs) or quantized by `--quantization w8a8_int8` or `fp8`, or 4-bit, without a bias
(layers/quantization.py, layers/int4.py: the chain calls their kernels, and for gate_up the kernel then
SiLU-and-mul, as the modules do); Qwen3's per-head q/k norms, where present, in bf16; the GPT-NeoX rotary of
engine/layers/rotary_embedding.py; the torch_native backend's native decode kernel over a bf16 pool;
a decode batch; every kernel family on (ENGINE_CPU_KERNEL_*: with one off, its torch path runs in the
modules). Measured on the 2-core
AMD EPYC (Zen 4), small Llama (8 layers), ModelRunner with every kernel replaced by an empty one: the
Python of a decode step 1.8-2.2 ms through the modules, 0.3-0.8 ms with this call; the real step,
alternating the two in one process: batch 1 10.1 -> 8.3 ms, batch 16 18.3 -> 16.0 ms, batch 64 x 1k
context 104.8 -> 94.7 ms. With w8a8_int8 on the 2-core Xeon with AMX (bench_quant's 8-layer model, one
thread, CPU time): batch-1 step 15.0 -> 13.0 ms (bf16 23.1), 1.77x bf16 where the modules gave 1.48x.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Tuple

import torch
from torch import nn

from engine.distributed.parallel_state import get_tp_size
from engine.kernels import library, ops
from engine.kernels.boundary import Layer, Step
from engine.kernels.attention import CascadeTables
from engine.kernels.linear import (CHAIN_BF16, CHAIN_FP8, CHAIN_Q4, CHAIN_W4A8, CHAIN_W8A8, LINEAR_BF16_MAX_ROWS,
                                   Bf16Panels, address_or_none)
from engine.layers.int4 import Int4Weight
from engine.layers.moe.sparse_block import SparseMoeBlock
from engine.layers.quantization import QuantizedWeight
from engine.layers.attention.torch_native_backend import TorchNativeAttnBackend

if TYPE_CHECKING:
    from engine.model_executor.forward_batch_info import ForwardBatch
    from engine.models.llama import LlamaDecoderLayer, LlamaMLP

class _LayerRefs:
    """The modules and tensors a layer's table entry points into, looked up once: reaching them through
    nn.Module attributes every step cost ~15 us a layer. The addresses are still read every step
    (`pointers`), from the parameter and buffer dicts, so a swapped `param.data` or a repack is seen; a linear's
    fields are worked out again only when its packed weight is another object (a repack makes a new one), which
    took a decode step's check of 8 layers from 124-212 us to 46 (2-core Xeon)."""

    def __init__(self, layer: "LlamaDecoderLayer") -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.linears: Tuple[nn.Module, ...] = (attn.qkv_proj, attn.o_proj)
        self.moe: Optional[SparseMoeBlock] = None
        if isinstance(mlp, SparseMoeBlock):
            self.moe = mlp
        else:
            self.linears += (mlp.gate_up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm)
        self.norm_params = tuple(None if n is None else n._parameters for n in norms)
        self.rope_buffers = attn.rotary_emb._buffers
        self.layer_id = attn.attn.layer_id
        self.linear_names = [tuple(f"{name}{suffix}" for suffix in _LINEAR_FIELDS)
                             for name in ("qkv", "o", "gate_up", "down")[:len(self.linears)]]
        # Per linear: (its packed weight, whether it has a bias) -> its fields, for the last packed weight seen
        # (held, so that no other object can take its identity).
        self._chained: List[Tuple[object, bool, Optional[Tuple[Tuple[str, object], ...]]]] = [
            (None, False, None) for _ in self.linears]

    def pointers(self, k_pool: torch.Tensor, v_pool: torch.Tensor) -> Optional[Tuple[Tuple[str, object], ...]]:
        """Every field of the layer_t this layer fills, as (name, value) pairs: addresses, formats, groups (None:
        a linear the chain cannot run). A table is valid exactly while these stay the same."""
        fields: List[Tuple[str, object]] = []
        for i, linear in enumerate(self.linears):
            packed, has_bias = linear.packed_weight, linear.bias is not None
            seen, seen_bias, linear_fields = self._chained[i]
            if seen is not packed or seen_bias != has_bias or packed is None:
                chained = _chained_linear(linear)
                linear_fields = None if chained is None else tuple(zip(self.linear_names[i], chained))
                self._chained[i] = (packed, has_bias, linear_fields)
            if linear_fields is None:
                return None
            fields += linear_fields
        if self.moe is not None:
            router, experts = self.moe.gate.packed_weight, self.moe.experts.packed_weight
            if not isinstance(router, Bf16Panels) or experts is None:
                return None
            fields += [("router", router.data.data_ptr()), ("experts_format", experts.format),
                       ("experts_gate_up", experts.gate_up_addresses.data_ptr()),
                       ("experts_gate_up_scale", address_or_none(experts.gate_up_scale_addresses)),
                       ("experts_down", experts.down_addresses.data_ptr()),
                       ("experts_down_scale", address_or_none(experts.down_scale_addresses)),
                       ("moe_intermediate", experts.intermediate)]
        norms = [None if d is None else address_or_none(d["weight"]) for d in self.norm_params]
        fields += [("input_norm", norms[0]), ("post_norm", norms[1]), ("q_norm", norms[2]), ("k_norm", norms[3]),
                   ("cos_sin", address_or_none(self.rope_buffers["cos_sin_cache"])), ("k_pool", k_pool.data_ptr()),
                   ("v_pool", v_pool.data_ptr())]
        return tuple(fields)


# A chained linear's layer_t fields: its name + each suffix (the CHAIN_* formats of kernels/linear.py).
_LINEAR_FIELDS = ("", "_bias", "_format", "_scale", "_offset", "_group")


def _chained_linear(linear: nn.Module) -> Optional[Tuple[int, Optional[int], int, Optional[int], Optional[int], int]]:
    """(weight, bias, format, scale, offset, group) of a linear the chain runs as the module does (None: it
    cannot): bf16 panels; w8a8_int8 (int8 activations) or fp8 without a bias; 4-bit without a bias or act-order."""
    p = linear.packed_weight
    if isinstance(p, Bf16Panels):
        return p.data.data_ptr(), address_or_none(p.bias), CHAIN_BF16, None, None, 0
    if linear.bias is not None:
        return None
    if (isinstance(p, QuantizedWeight) and (p.int8_activations or p.is_fp8) and p.qweight.is_cpu
            and p.qweight.is_contiguous() and p.scale.dtype == torch.float32 and p.scale.is_contiguous()):
        return p.qweight.data_ptr(), None, CHAIN_FP8 if p.is_fp8 else CHAIN_W8A8, p.scale.data_ptr(), None, 0
    if (isinstance(p, Int4Weight) and p.perm is None and p.packed.is_cpu
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in (p.scale, p.bias))):
        return (p.packed.data_ptr(), None, CHAIN_W4A8 if p.int8_activations else CHAIN_Q4, p.scale.data_ptr(),
                p.bias.data_ptr(), p.group_size)
    return None


def _mlp_chained(mlp: "LlamaMLP", hidden: int) -> bool:
    """Whether the chain runs a Llama MLP: its linears chained, gate_up of two equal halves."""
    if _chained_linear(mlp.gate_up_proj) is None or _chained_linear(mlp.down_proj) is None:
        return False
    gate_up, down = mlp.gate_up_proj.packed_weight, mlp.down_proj.packed_weight
    assert isinstance(gate_up, (Bf16Panels, QuantizedWeight, Int4Weight))
    assert isinstance(down, (Bf16Panels, QuantizedWeight, Int4Weight))
    if isinstance(gate_up, Bf16Panels) and gate_up.n % 128:  # linear_bf16_silu_mul's panel pairs
        return False
    return (gate_up.k == hidden and down.n == hidden and gate_up.n == 2 * down.k and not mlp.gate_up_proj.gather_output
            and mlp.gate_up_proj.output_sizes == [down.k, down.k])


def _moe_chained(block: SparseMoeBlock, hidden: int) -> bool:
    """Whether the chain runs a sparse MoE block as the modules do: a bf16-panel router without a bias, every
    expert local and native (FusedMoE.pack_native: bf16 panels, int8 or fp8), no shared expert."""
    router, experts = block.gate.packed_weight, block.experts.packed_weight
    return (block.shared_expert is None and block.gate.bias is None and isinstance(router, Bf16Panels)
            and experts is not None and router.n == block.experts.num_experts and router.k == hidden
            and block.experts.num_local_experts == block.experts.num_experts and experts.hidden == hidden
            and library.ops() is not None)


class DecoderLayers:
    """The layers' weights and pools in decoder_layers.c's layout, and the shapes they imply."""

    def __init__(self, layers: List["LlamaDecoderLayer"], k_pools: List[torch.Tensor], v_pools: List[torch.Tensor],
                 pointers: List[Tuple[Tuple[str, object], ...]]) -> None:
        first = layers[0].self_attn
        self.hidden = first.qkv_proj.input_size
        self.heads, self.kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.rotary_dim = first.rotary_emb.rotary_dim
        dense = [layer.mlp for layer in layers if not isinstance(layer.mlp, SparseMoeBlock)]
        self.intermediate = dense[0].down_proj.input_size if dense else 0  # supported(): one size
        moe = [layer.mlp for layer in layers if isinstance(layer.mlp, SparseMoeBlock)]
        # supported(): every MoE layer routes alike
        self.num_experts, self.top_k = (moe[0].experts.num_experts, moe[0].experts.top_k) if moe else (0, 0)
        self.renormalize = bool(moe) and moe[0].experts.renormalize
        # The layers whose chosen experts the recorder counts: (index in the table, the layer's id, recorder).
        self.recorded = [(i, layer.mlp.experts.layer_id, layer.mlp.experts.recorder) for i, layer in enumerate(layers)
                         if isinstance(layer.mlp, SparseMoeBlock) and layer.mlp.experts.recorder is not None]
        self.table = (Layer * len(layers))()
        # Each table entry's layer: its row of a cascade's kept panels (CascadeTables.kept).
        self.layer_ids = torch.tensor([layer.self_attn.attn.layer_id for layer in layers], dtype=torch.int64)
        for entry, layer, k_pool, v_pool, fields in zip(self.table, layers, k_pools, v_pools, pointers):
            for name, value in fields:
                setattr(entry, name, value)
            entry.k_stride, entry.v_stride = k_pool.stride(0), v_pool.stride(0)
            entry.eps = layer.input_layernorm.variance_epsilon  # supported(): both norms' eps agree
            entry.scale = layer.self_attn.attn.scaling
            if layer.self_attn.q_norm is not None:  # supported(): q_norm's and k_norm's eps agree
                entry.qk_eps = layer.self_attn.q_norm.variance_epsilon

    @staticmethod
    def supported(layers: List["LlamaDecoderLayer"], k_pools: List[torch.Tensor], v_pools: List[torch.Tensor]) -> bool:
        """Whether the native chain computes these layers (the conditions of the module docstring)."""
        lib, linears = library.decoder_layers(), library.linear()
        if not (layers and lib is not None and linears is not None and get_tp_size() == 1):
            return False
        first = layers[0].self_attn
        hidden, heads, kv_heads, dim = first.qkv_proj.input_size, first.num_heads, first.num_kv_heads, first.head_dim
        routing = {(m.experts.num_experts, m.experts.top_k, m.experts.renormalize)
                   for m in (layer.mlp for layer in layers) if isinstance(m, SparseMoeBlock)}
        intermediates = {m.down_proj.input_size for m in (layer.mlp for layer in layers)
                         if not isinstance(m, SparseMoeBlock)}
        if len(routing) > 1 or len(intermediates) > 1:
            return False
        for layer, k_pool, v_pool in zip(layers, k_pools, v_pools):
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o = attn.qkv_proj.packed_weight, attn.o_proj.packed_weight
            rope = attn.rotary_emb
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if _chained_linear(attn.qkv_proj) is None or _chained_linear(attn.o_proj) is None:
                return False
            kinds = (Bf16Panels, QuantizedWeight, Int4Weight)
            assert isinstance(qkv, kinds) and isinstance(o, kinds)
            if isinstance(mlp, SparseMoeBlock):
                if not _moe_chained(mlp, hidden):
                    return False
            elif not _mlp_chained(mlp, hidden):
                return False
            q_norm, k_norm = attn.q_norm, attn.k_norm
            if q_norm is not None or k_norm is not None:
                if q_norm is None or k_norm is None or q_norm.variance_epsilon != k_norm.variance_epsilon:
                    return False
                if any(n.weight.dtype != torch.bfloat16 or not n.weight.is_contiguous() or n.hidden_size != dim
                       for n in (q_norm, k_norm)):
                    return False
            if ((attn.num_heads, attn.num_kv_heads, attn.head_dim) != (heads, kv_heads, dim)
                    or qkv.k != hidden or qkv.n != (heads + 2 * kv_heads) * dim or o.k != heads * dim or o.n != hidden):
                return False
            if any(n.weight.dtype != torch.bfloat16 or not n.weight.is_contiguous() or n.hidden_size != hidden
                   or n.variance_epsilon != layer.input_layernorm.variance_epsilon for n in norms):
                return False
            if not (rope.rotary_dim == first.rotary_emb.rotary_dim and rope.head_size == dim
                    and rope.rotary_dim % 2 == 0 and rope.rotary_dim <= ops.MAX_ROTARY_DIM and rope.cos_sin_cache.dtype == torch.float32
                    and rope.cos_sin_cache.is_contiguous() and rope.cos_sin_cache.is_cpu):
                return False
            for pool in (k_pool, v_pool):
                if (pool.dtype != torch.bfloat16 or not pool.is_cpu or not pool.is_contiguous() or pool.dim() != 3
                        or pool.shape[1:] != (kv_heads, dim)):
                    return False
        return True

    def run(self, hidden_states: torch.Tensor, positions: torch.Tensor, kv_indices: torch.Tensor, lens: torch.Tensor,
            cascade: Optional[CascadeTables],
            out_cache_loc: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after the last layer, for the embedded tokens of a decode batch."""
        bs = hidden_states.shape[0]
        hidden_in = hidden_states.contiguous()
        positions = positions.to(torch.int64).contiguous()
        out_cache_loc = out_cache_loc.to(torch.int64).contiguous()
        kv_indices = kv_indices.contiguous()
        lens = lens.to(torch.int64).contiguous()
        q_width = self.heads * self.head_dim
        widths = [self.hidden, q_width + 2 * self.kv_heads * self.head_dim, q_width, q_width, self.hidden,
                  self.intermediate, 2 * self.intermediate, self.num_experts]
        scratch = torch.empty(bs * sum(widths), dtype=torch.bfloat16)
        views, start = [], 0
        for w in widths:
            views.append(scratch[start:start + bs * w].data_ptr())
            start += bs * w
        # A model with MoE layers: the top-k weights (scratch) and every layer's chosen experts (for the recorder).
        moe_weights = torch.empty(bs * self.top_k, dtype=torch.float32) if self.top_k else None
        moe_ids = torch.empty(len(self.table), bs, self.top_k, dtype=torch.int32) if self.top_k else None
        out = torch.empty_like(hidden_in)
        residual = torch.empty_like(hidden_in)
        s = Step()
        s.hidden, s.heads, s.kv_heads, s.head_dim = self.hidden, self.heads, self.kv_heads, self.head_dim
        s.rotary_dim, s.intermediate, s.bs = self.rotary_dim, self.intermediate, bs
        s.positions, s.out_loc = positions.data_ptr(), out_cache_loc.data_ptr()
        s.kv_indices, s.lens, s.max_len = kv_indices.data_ptr(), lens.data_ptr(), kv_indices.shape[1]
        if cascade is not None and cascade.prefix_lens.numel():
            s.num_groups, s.max_prefix = cascade.prefix_lens.numel(), cascade.prefix_indices.shape[1]
            s.group_offsets, s.group_members = cascade.group_offsets.data_ptr(), cascade.members.data_ptr()
            s.prefix_indices, s.prefix_lens = cascade.prefix_indices.data_ptr(), cascade.prefix_lens.data_ptr()
            s.group_of = cascade.group_of.data_ptr()
            if cascade.kept is not None and cascade.kept_tokens is not None:
                kept = cascade.kept.index_select(0, self.layer_ids)  # alive until the call returns
                s.kept, s.kept_tokens = kept.data_ptr(), cascade.kept_tokens.data_ptr()
        s.normed, s.qkv, s.q, s.attn, s.o, s.mlp, s.gate_up, s.router_logits = views
        s.num_experts, s.top_k, s.renormalize = self.num_experts, self.top_k, int(self.renormalize)
        s.moe_weights, s.moe_ids = address_or_none(moe_weights), address_or_none(moe_ids)
        s.num_threads = torch.get_num_threads()
        lib = library.decoder_layers()
        assert lib is not None, "the decoder layers kernel is not loaded: supported() said it was"
        lib.decode_layers(self.table, len(self.table), s, hidden_in.data_ptr(), out.data_ptr(), residual.data_ptr())
        if moe_ids is not None:
            for index, layer_id, recorder in self.recorded:  # as FusedMoE.forward records
                recorder.record(layer_id, moe_ids[index])
        return out, residual


class DecoderLayersCache:
    """The DecoderLayers of a model's layers, rebuilt when a packed weight or a KV pool changes (weight
    updates repack; releasing and resuming memory makes new pools)."""

    def __init__(self) -> None:
        self._refs: List[_LayerRefs] = []
        self._key: Optional[List[Optional[tuple]]] = None
        self._plan: Optional[DecoderLayers] = None

    def forward(self, layers: List["LlamaDecoderLayer"], hidden_states: torch.Tensor, positions: torch.Tensor,
                forward_batch: "ForwardBatch") -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """(hidden, residual) after the layers, or None where the modules must run them."""
        backend, pool = forward_batch.attn_backend, forward_batch.token_to_kv_pool
        if (library.decoder_layers() is None or not forward_batch.forward_mode.is_decode()
                or forward_batch.lora_ids is not None  # the native layers have no LoRA delta
                or not isinstance(backend, TorchNativeAttnBackend)
                or pool is None or hidden_states.dtype != torch.bfloat16 or not hidden_states.is_cpu
                or not positions.is_cpu or hidden_states.shape[0] > LINEAR_BF16_MAX_ROWS):
            return None
        tables = backend.native_decode_tables(forward_batch)
        if tables is None:
            return None
        if len(self._refs) != len(layers):  # a model's layers are fixed: looked up on its first decode
            self._refs = [_LayerRefs(layer) for layer in layers]
        k_pools = [pool.get_key_buffer(r.layer_id) for r in self._refs]
        v_pools = [pool.get_value_buffer(r.layer_id) for r in self._refs]
        pointers = [r.pointers(k, v) for r, k, v in zip(self._refs, k_pools, v_pools)]
        if pointers != self._key:
            self._key = pointers
            self._plan = None
            if all(p is not None for p in pointers) and DecoderLayers.supported(layers, k_pools, v_pools):
                self._plan = DecoderLayers(layers, k_pools, v_pools, [p for p in pointers if p is not None])
        if self._plan is None:
            return None
        kv_indices, lens, cascade = tables
        return self._plan.run(hidden_states, positions, kv_indices, lens, cascade, forward_batch.out_cache_loc)
