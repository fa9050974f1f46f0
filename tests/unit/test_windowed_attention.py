"""layers/attention/windowed.py against a float64 reference written query by query: the window
(a query at p sees (p - window, p]), the logit soft-cap, attention sinks (gpt-oss: a per-head logit in
the softmax's denominator only), GQA; a decode step reads the same answer as the extend's last row."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from engine.layers.attention import windowed
from engine.layers.radix_attention import RadixAttention

HEADS, KV_HEADS, DIM = 4, 2, 8


def _reference(q, k, v, window: int, cap: float, sinks, scale: float, prefix_len: int) -> torch.Tensor:
    """q [T, H, D] at positions prefix_len.., k/v [S, KH, D] at positions 0..S-1."""
    out = torch.zeros(q.shape[0], HEADS, DIM, dtype=torch.float64)
    group = HEADS // KV_HEADS
    for i in range(q.shape[0]):
        p = prefix_len + i
        for h in range(HEADS):
            logits = []
            for j in range(p + 1):
                if window > 0 and j <= p - window:
                    continue
                s = float(q[i, h].double() @ k[j, h // group].double()) * scale
                logits.append((j, cap * math.tanh(s / cap) if cap > 0 else s))
            sink = float(sinks[h]) if sinks is not None else -math.inf
            top = max(max(s for _, s in logits), sink)
            denom = sum(math.exp(s - top) for _, s in logits) + math.exp(sink - top)
            for j, s in logits:
                out[i, h] += math.exp(s - top) / denom * v[j, h // group].double()
    return out.view(q.shape[0], -1)


def _batch(seq_len: int, ext_len: int, k_buf, v_buf, slots):
    table = torch.zeros(2, 64, dtype=torch.int32)
    table[1, :seq_len] = slots
    return SimpleNamespace(
        token_to_kv_pool=SimpleNamespace(get_kv_buffer=lambda layer_id: (k_buf, v_buf),
                                         kv_slots=lambda layer_id, slots: slots,
                                         read_k=lambda layer_id, rows, dtype: rows.to(dtype),
                                         read_v=lambda layer_id, rows, dtype: rows.to(dtype)),
        req_to_token_pool=SimpleNamespace(req_to_token=table),
        req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([seq_len]), seq_lens_cpu=[seq_len],
        extend_seq_lens_cpu=[ext_len], extend_prefix_lens_cpu=[seq_len - ext_len])


@pytest.mark.parametrize("window,cap,with_sinks", [(5, 0.0, False), (5, 3.0, True), (-1, 2.0, False),
                                                   (-1, 0.0, True), (40, 0.0, False)])
def test_windowed_extend_and_decode_match_the_reference(window, cap, with_sinks):
    gen = torch.Generator().manual_seed(0)
    seq_len, ext_len = 23, 9
    k_buf = torch.randn(40, KV_HEADS, DIM, generator=gen) * 2
    v_buf = torch.randn(40, KV_HEADS, DIM, generator=gen)
    slots = torch.randperm(39, generator=gen)[:seq_len] + 1  # scattered pool slots, 0 is padding
    layer = RadixAttention(HEADS, DIM, DIM**-0.5, KV_HEADS, 0, sliding_window_size=window, logit_cap=cap,
                           with_sinks=with_sinks)
    if layer.sinks is not None:
        layer.sinks.data = torch.randn(HEADS, generator=gen)
    assert not layer.is_plain
    q = torch.randn(ext_len, HEADS, DIM, generator=gen) * 2
    k, v = k_buf[slots.long()], v_buf[slots.long()]
    expected = _reference(q, k, v, window, cap, layer.sinks, layer.scaling, seq_len - ext_len)
    with torch.no_grad():
        got = windowed.windowed_extend(q.view(ext_len, -1), layer, _batch(seq_len, ext_len, k_buf, v_buf, slots))
        decoded = windowed.windowed_decode(q[-1:].reshape(1, -1), layer, _batch(seq_len, 1, k_buf, v_buf, slots))
    assert (got.double() - expected).abs().max().item() < 1e-5
    assert (decoded.double() - expected[-1:]).abs().max().item() < 1e-5


def test_bad_window_and_cap_are_refused():
    with pytest.raises(ValueError, match="sliding_window_size"):
        RadixAttention(HEADS, DIM, 1.0, KV_HEADS, 0, sliding_window_size=0)
    with pytest.raises(ValueError, match="logit_cap"):
        RadixAttention(HEADS, DIM, 1.0, KV_HEADS, 0, logit_cap=-1.0)
    assert RadixAttention(HEADS, DIM, 1.0, KV_HEADS, 0).is_plain
