"""Attention of the layers that are not plain full attention: a sliding window, a logit soft-cap
(Gemma 2) or attention sinks (gpt-oss), in torch, for any backend that has no kernel for them.

A query at position p sees the keys at positions (p - window, p] of its own request (the window counts
the query's token: Hugging Face's `sliding_window`), all of 0..p without a window. Scores are computed
in float32: s = scale * q.k, then cap * tanh(s / cap) with a cap, masked, and with sinks each head's
sink logit joins the softmax's denominator (its probability mass is dropped, as gpt-oss does).

Only the keys a query can see are read from the pool: a decode step reads at most `window` slots per
request, so its cost on a windowed layer does not grow with the context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

import torch

if TYPE_CHECKING:
    from engine.layers.radix_attention import RadixAttention
    from engine.model_executor.forward_batch_info import ForwardBatch


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
           logit_cap: float, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """q [B, Tq, H, D], k/v [B, Tk, KH, D], visible [B, Tq, Tk] bool -> [B, Tq, H * D] in q's dtype.
    H is a multiple of KH (GQA: `group` consecutive query heads share a KV head)."""
    bs, tq, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    qf = q.float().view(bs, tq, kv_heads, group, dim)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qf, k.float()) * scale
    if logit_cap > 0:
        scores = torch.tanh(scores / logit_cap) * logit_cap
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, kv_heads, group, 1, 1).expand(bs, kv_heads, group, tq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.float())
    return out.reshape(bs, tq, heads * dim).to(q.dtype)


def _pool_kv(forward_batch: "ForwardBatch", layer: "RadixAttention"):
    pool = forward_batch.token_to_kv_pool
    assert pool is not None  # ForwardBatch.init_new sets it
    return pool.get_kv_buffer(layer.layer_id)


def _read_kv(forward_batch: "ForwardBatch", layer: "RadixAttention", k: torch.Tensor, v: torch.Tensor):
    """Rows taken from the pool as float32 (an fp8 pool's dequantized by the layer's scales)."""
    pool = forward_batch.token_to_kv_pool
    assert pool is not None  # ForwardBatch.init_new sets it
    return pool.read_k(layer.layer_id, k, torch.float32), pool.read_v(layer.layer_id, v, torch.float32)


def _layer_slots(forward_batch: "ForwardBatch", layer: "RadixAttention", slots: torch.Tensor) -> torch.Tensor:
    """The layer's own slots for these full-pool slots (the hybrid pool keeps windowed layers apart)."""
    pool = forward_batch.token_to_kv_pool
    assert pool is not None  # ForwardBatch.init_new sets it
    return pool.kv_slots(layer.layer_id, slots)


def windowed_decode(q: torch.Tensor, layer: "RadixAttention", forward_batch: "ForwardBatch") -> torch.Tensor:
    """One query per request, [bs, H * D]; the K/V of this step are already in the pool."""
    assert forward_batch.req_to_token_pool is not None  # ForwardBatch.init_new sets it
    k_buf, v_buf = _pool_kv(forward_batch, layer)
    table = forward_batch.req_to_token_pool.req_to_token
    seq_lens = forward_batch.seq_lens
    bs = q.shape[0]
    longest = max(forward_batch.seq_lens_cpu)
    window = layer.sliding_window_size
    span = min(window, longest) if window > 0 else longest
    # Each request's last `span` positions; those before position 0 are padding.
    cols = (seq_lens - span).unsqueeze(1) + torch.arange(span, device=seq_lens.device)
    visible = cols >= 0
    slots = table[forward_batch.req_pool_indices.unsqueeze(1), cols.clamp(min=0)].long()
    slots = torch.where(visible, slots, torch.zeros_like(slots))  # slot 0 is the pool's padding slot
    slots = _layer_slots(forward_batch, layer, slots)
    kv_heads, dim = layer.tp_k_head_num, layer.head_dim
    k, v = _read_kv(forward_batch, layer, k_buf.index_select(0, slots.view(-1)), v_buf.index_select(0, slots.view(-1)))
    k, v = k.view(bs, span, kv_heads, dim), v.view(bs, span, kv_heads, dim)
    qv = q.view(bs, 1, layer.tp_q_head_num, dim)
    return attend(qv, k, v, visible.unsqueeze(1), layer.scaling, layer.logit_cap, layer.sinks).view(bs, -1)


def windowed_extend(q: torch.Tensor, layer: "RadixAttention", forward_batch: "ForwardBatch") -> torch.Tensor:
    """Every new token of every request, [T, H * D]; the K/V of the new tokens are already in the pool.
    One attention per request over the keys its first new token can see and everything after."""
    fb = forward_batch
    assert fb.req_to_token_pool is not None  # ForwardBatch.init_new sets these for an extend batch
    assert fb.extend_seq_lens_cpu is not None and fb.extend_prefix_lens_cpu is not None
    k_buf, v_buf = _pool_kv(fb, layer)
    table = fb.req_to_token_pool.req_to_token
    heads, kv_heads, dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
    window = layer.sliding_window_size
    q = q.view(-1, heads, dim)
    outputs: List[torch.Tensor] = []
    rows: List[int] = fb.req_pool_indices.tolist()
    q_start = 0
    for row, seq_len, ext_len, prefix_len in zip(rows, fb.seq_lens_cpu, fb.extend_seq_lens_cpu,
                                                 fb.extend_prefix_lens_cpu):
        if ext_len == 0:
            continue
        first_key = max(0, prefix_len - window + 1) if window > 0 else 0
        slots = _layer_slots(fb, layer, table[row, first_key:seq_len].long())
        k, v = _read_kv(fb, layer, k_buf.index_select(0, slots), v_buf.index_select(0, slots))
        k, v = k.view(1, -1, kv_heads, dim), v.view(1, -1, kv_heads, dim)
        q_pos = torch.arange(prefix_len, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(first_key, seq_len, device=q.device).unsqueeze(0)
        visible = k_pos <= q_pos
        if window > 0:
            visible &= k_pos > q_pos - window
        q_seq = q[q_start:q_start + ext_len].unsqueeze(0)
        outputs.append(attend(q_seq, k, v, visible.unsqueeze(0), layer.scaling, layer.logit_cap, layer.sinks)[0])
        q_start += ext_len
    if not outputs:
        return q.new_empty(0, heads * dim)
    return torch.cat(outputs)
