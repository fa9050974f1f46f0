"""Layers against plain-torch / transformers references, including simulated tensor parallelism."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

import engine.layers.linear as linear_mod
import engine.layers.vocab_parallel_embedding as vocab_mod
from engine.layers.activation import SiluAndMul
from engine.layers.attention.torch_native_backend import TorchNativeAttnBackend
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.logits_processor import LogitsProcessor
from engine.layers.radix_attention import RadixAttention
from engine.layers.rotary_embedding import get_rope
from engine.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode, ModelWorkerBatch


def _set_tp(monkeypatch, module, rank: int, size: int) -> None:
    monkeypatch.setattr(module, "get_tp_rank", lambda: rank)
    monkeypatch.setattr(module, "get_tp_size", lambda: size)


# ---------------------------------------------------------------------------- norm, act, rope
def test_rmsnorm_plain_and_fused_residual():
    torch.manual_seed(0)
    norm = RMSNorm(32, eps=1e-5)
    norm.weight.data = torch.randn(32)
    x, res = torch.randn(5, 32), torch.randn(5, 32)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    assert torch.allclose(norm(x), ref, atol=1e-6)
    out, new_res = norm(x, res)
    s = x + res
    assert torch.allclose(new_res, s)
    assert torch.allclose(out, s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight, atol=1e-6)


def test_silu_and_mul():
    x = torch.randn(3, 8)
    assert torch.allclose(SiluAndMul()(x), F.silu(x[:, :4]) * x[:, 4:])


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 32},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "beta_fast": 16,
         "beta_slow": 2, "mscale": 0.7, "mscale_all_dim": 0.5},
    ],
)
def test_rotary_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, heads, kv_heads, theta = 16, 4, 2, 10000.0
    cfg = dict(hidden_size=head_dim * heads, num_attention_heads=heads, max_position_embeddings=128)
    if scaling is not None:
        cfg["rope_scaling"] = dict(scaling, rope_theta=theta)
    else:
        cfg["rope_theta"] = theta
    hf_rope = LlamaRotaryEmbedding(LlamaConfig(**cfg))
    rope = get_rope(head_dim, head_dim, 128, theta, scaling)
    positions = torch.tensor([0, 1, 5, 77, 127, 3])
    q, k = torch.randn(6, heads * head_dim), torch.randn(6, kv_heads * head_dim)
    cos, sin = hf_rope(q, positions.unsqueeze(0))
    ref_q, ref_k = apply_rotary_pos_emb(
        q.view(1, 6, heads, head_dim).transpose(1, 2), k.view(1, 6, kv_heads, head_dim).transpose(1, 2), cos, sin
    )
    out_q, out_k = rope(positions, q, k)
    assert torch.allclose(out_q, ref_q.transpose(1, 2).reshape(6, -1), atol=1e-5)
    assert torch.allclose(out_k, ref_k.transpose(1, 2).reshape(6, -1), atol=1e-5)


def test_unknown_rope_type_is_rejected():
    with pytest.raises(ValueError, match="unsupported rope_scaling"):
        get_rope(16, 16, 64, 10000.0, {"rope_type": "longrope", "factor": 2.0})


# ---------------------------------------------------------------------------- tensor parallel linears
def test_column_and_row_parallel_shards_recompose(monkeypatch):
    torch.manual_seed(0)
    full_w, full_b = torch.randn(12, 8), torch.randn(12)
    row_w, row_b = torch.randn(8, 12), torch.randn(8)
    x = torch.randn(3, 8)
    tp = 3
    col_parts, row_sum = [], 0
    for rank in range(tp):
        _set_tp(monkeypatch, linear_mod, rank, tp)
        col = ColumnParallelLinear(8, 12, bias=True)
        col.weight.weight_loader(col.weight, full_w)
        col.bias.weight_loader(col.bias, full_b)
        part = col(x)
        col_parts.append(part)
        row = RowParallelLinear(12, 8, bias=True, reduce_results=False)
        row.weight.weight_loader(row.weight, row_w)
        row.bias.weight_loader(row.bias, row_b)
        row_sum = row_sum + F.linear(part, row.weight)  # what the all-reduce adds up
    assert torch.allclose(torch.cat(col_parts, -1), F.linear(x, full_w, full_b), atol=1e-5)
    ref = F.linear(F.linear(x, full_w, full_b), row_w, row_b)
    assert torch.allclose(row_sum + row_b, ref, atol=1e-5)


@pytest.mark.parametrize("tp,kv_heads", [(1, 2), (2, 2), (4, 2)])
def test_qkv_parallel_sharding_and_kv_replication(monkeypatch, tp, kv_heads):
    heads, head_dim, hidden = 4, 3, 6
    wq = torch.arange(heads * head_dim * hidden, dtype=torch.float32).view(heads * head_dim, hidden)
    wk = -torch.arange(kv_heads * head_dim * hidden, dtype=torch.float32).view(kv_heads * head_dim, hidden) - 1
    wv = wk - 1000
    for rank in range(tp):
        _set_tp(monkeypatch, linear_mod, rank, tp)
        layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=False)
        for shard, w in (("q", wq), ("k", wk), ("v", wv)):
            layer.weight.weight_loader(layer.weight, w, shard)
        q, k, v = layer.weight.split([layer.q_size, layer.kv_size, layer.kv_size])
        q_per = heads // tp * head_dim
        assert torch.equal(q, wq[rank * q_per : (rank + 1) * q_per])
        kv_head = rank // max(1, tp // kv_heads) if tp >= kv_heads else None
        if kv_head is not None:  # one (possibly replicated) KV head per rank
            assert layer.num_kv_heads == 1
            assert torch.equal(k, wk[kv_head * head_dim : (kv_head + 1) * head_dim])
            assert torch.equal(v, wv[kv_head * head_dim : (kv_head + 1) * head_dim])
        else:
            per = kv_heads // tp * head_dim
            assert torch.equal(k, wk[rank * per : (rank + 1) * per])


def test_merged_column_gate_up(monkeypatch):
    gate, up = torch.randn(8, 4), torch.randn(8, 4)
    for rank in range(2):
        _set_tp(monkeypatch, linear_mod, rank, 2)
        layer = MergedColumnParallelLinear(4, [8, 8], bias=False)
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        assert torch.equal(layer.weight, torch.cat([gate[rank * 4 : rank * 4 + 4], up[rank * 4 : rank * 4 + 4]]))


def test_vocab_parallel_embedding_and_lm_head(monkeypatch):
    vocab, dim, tp = 200, 8, 2
    table = torch.randn(vocab, dim)
    hidden = torch.randn(3, dim)
    ids = torch.tensor([0, 5, 127, 128, 199])
    total, logits_parts = 0, []
    for rank in range(tp):
        _set_tp(monkeypatch, vocab_mod, rank, tp)
        emb = VocabParallelEmbedding(vocab, dim)
        assert emb.num_embeddings_padded % (64 * tp) == 0 and emb.num_embeddings_padded >= vocab
        emb.weight.weight_loader(emb.weight, table)
        monkeypatch.setattr(vocab_mod, "tensor_model_parallel_all_reduce", lambda x: x)
        total = total + emb(ids)
        head = ParallelLMHead(vocab, dim)
        head.weight.weight_loader(head.weight, table)
        logits_parts.append(hidden @ head.weight.t())
    assert torch.allclose(total, table[ids])
    gathered = torch.cat(logits_parts, -1)  # what the all-gather builds
    assert torch.allclose(gathered[:, :vocab], hidden @ table.t(), atol=1e-5)
    assert torch.all(gathered[:, vocab:] == 0)  # padding rows are zero


# ---------------------------------------------------------------------------- attention backend
class _Runner:
    device = "cpu"


def _make_pool(num_slots=64, kv_heads=2, head_dim=8):
    pool = MHATokenToKVPool(num_slots, 1, torch.float32, kv_heads, head_dim, layer_num=1)
    table = ReqToTokenPool(4, 32)
    return pool, table


def _reference_attention(q, k, v, scaling, causal_offset):
    """q [ext, H, D]; k, v [seq, KH, D]; query i sees keys <= causal_offset + i."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scaling
    mask = torch.arange(k.shape[0])[None, :] <= (torch.arange(q.shape[0])[:, None] + causal_offset)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _batch(mode, rows, seq_lens, out_loc, pool, table, prefix_lens=None, ext_lens=None):
    mwb = ModelWorkerBatch(
        forward_mode=mode,
        input_ids=torch.zeros(len(out_loc), dtype=torch.int64),
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=list(seq_lens),
        out_cache_loc=torch.tensor(out_loc),
        extend_seq_lens=ext_lens,
        extend_prefix_lens=prefix_lens,
    )
    runner = _Runner()
    runner.req_to_token_pool, runner.token_to_kv_pool = table, pool
    runner.attn_backend = TorchNativeAttnBackend(runner)
    fb = ForwardBatch.init_new(mwb, runner)
    runner.attn_backend.init_forward_metadata(fb)
    return fb


def test_torch_native_extend_with_prefix_and_decode_match_reference(decode_path):
    torch.manual_seed(0)
    heads, kv_heads, d = 4, 2, 8
    pool, table = _make_pool(kv_heads=kv_heads, head_dim=d)
    layer = RadixAttention(heads, d, 1 / math.sqrt(d), kv_heads, layer_id=0)
    # Two requests whose prefixes (3 and 0 tokens) are already in the pool at scattered slots.
    slots = {1: [40, 7, 22, 9, 30, 11], 2: [5, 6, 50, 51]}
    for row, s in slots.items():
        table.req_to_token[row, : len(s)] = torch.tensor(s, dtype=torch.int32)
    all_k = {row: torch.randn(len(s), kv_heads, d) for row, s in slots.items()}
    all_v = {row: torch.randn(len(s), kv_heads, d) for row, s in slots.items()}
    pool.set_kv_buffer(0, torch.tensor(slots[1][:3]), all_k[1][:3], all_v[1][:3])
    prefix = {1: 3, 2: 0}
    q = {row: torch.randn(len(s) - prefix[row], heads, d) for row, s in slots.items()}

    fb = _batch(ForwardMode.EXTEND, [1, 2], [6, 4], slots[1][3:] + slots[2], pool, table, [3, 0], [3, 4])
    k_new = torch.cat([all_k[1][3:], all_k[2]]).reshape(7, -1)
    v_new = torch.cat([all_v[1][3:], all_v[2]]).reshape(7, -1)
    out = layer(torch.cat([q[1], q[2]]).reshape(7, -1), k_new, v_new, fb).view(7, heads, d)
    ref1 = _reference_attention(q[1], all_k[1], all_v[1], layer.scaling, 3)
    ref2 = _reference_attention(q[2], all_k[2], all_v[2], layer.scaling, 0)
    assert torch.allclose(out, torch.cat([ref1, ref2]), atol=1e-5)

    # Decode one more token for both requests in one batched op (different lengths -> padding).
    table.req_to_token[1, 6] = 60
    table.req_to_token[2, 4] = 61
    kd, vd, qd = torch.randn(2, kv_heads, d), torch.randn(2, kv_heads, d), torch.randn(2, heads, d)
    fb = _batch(ForwardMode.DECODE, [1, 2], [7, 5], [60, 61], pool, table)
    out = layer(qd.reshape(2, -1), kd.reshape(2, -1), vd.reshape(2, -1), fb).view(2, heads, d)
    for i, row in enumerate([1, 2]):
        k_all = torch.cat([all_k[row], kd[i : i + 1]])
        v_all = torch.cat([all_v[row], vd[i : i + 1]])
        ref = _reference_attention(qd[i : i + 1], k_all, v_all, layer.scaling, k_all.shape[0] - 1)
        assert torch.allclose(out[i], ref[0], atol=1e-5)
    assert torch.equal(pool.k_buffer[0][60], kd[0])  # the new K/V were stored


# ---------------------------------------------------------------------------- logits processor
class _Cfg:
    vocab_size = 10


def test_logits_processor_extend_decode_and_input_logprobs():
    torch.manual_seed(0)
    head = torch.nn.Module()
    head.weight = torch.nn.Parameter(torch.randn(64, 4))  # padded vocab 64, real 10
    head.packed_weight = None  # an LM head's attributes (ParallelLMHead)
    lp = LogitsProcessor(_Cfg())
    hidden = torch.randn(7, 4)
    full = (hidden @ head.weight.t())[:, :10]

    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=2, input_ids=torch.zeros(7, dtype=torch.long),
        positions=torch.zeros(7, dtype=torch.long), req_pool_indices=torch.tensor([1, 2]),
        seq_lens=torch.tensor([3, 4]), seq_lens_cpu=[3, 4], out_cache_loc=torch.arange(7),
        extend_seq_lens=torch.tensor([3, 4]), extend_start_loc=torch.tensor([0, 3]),
        extend_seq_lens_cpu=[3, 4], extend_prefix_lens_cpu=[0, 0],
    )
    out = lp(fb.input_ids, hidden, head, fb)
    assert torch.allclose(out.next_token_logits, full[[2, 6]])
    assert out.input_token_logprobs is None

    fb.return_logprob = True
    fb.extend_logprob_start_lens_cpu = [1, 4]  # request 1 asks none
    fb.extend_input_logprob_token_ids = torch.tensor([7, 3])
    fb.top_logprobs_nums = [2, 0]
    out = lp(fb.input_ids, hidden, head, fb)
    logprobs = full.log_softmax(-1)
    assert torch.allclose(out.input_token_logprobs, torch.stack([logprobs[1, 7], logprobs[2, 3]]), atol=1e-6)
    assert out.input_top_logprobs_idx[0] == logprobs[1:3].topk(2).indices.tolist()
    assert out.input_top_logprobs_val[1] == []

    fb.forward_mode = ForwardMode.DECODE
    out = lp(fb.input_ids, hidden, head, fb)
    assert out.next_token_logits.shape == (7, 10) and out.next_token_logits.dtype == torch.float32


def test_input_logprobs_are_computed_in_bounded_chunks_with_the_same_results(monkeypatch):
    """A long prompt asking for input logprobs from position 0 must not materialise one
    [positions, vocab] float32 matrix: the logits are built a fixed number of positions at a time,
    and the results equal the one-shot computation."""
    torch.manual_seed(1)
    vocab, hidden_size, lens, starts = 50, 8, [61, 40], [0, 5]
    head = torch.nn.Module()
    head.weight = torch.nn.Parameter(torch.randn(vocab, hidden_size))
    head.packed_weight = None  # an LM head's attributes (ParallelLMHead)
    cfg = type("Cfg", (), {"vocab_size": vocab})()
    total = sum(lens)
    hidden = torch.randn(total, hidden_size)
    locs = [0, lens[0]]
    targets = torch.randint(0, vocab, (sum(n - s for n, s in zip(lens, starts)),))

    def batch():
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=2, input_ids=torch.zeros(total, dtype=torch.long),
            positions=torch.zeros(total, dtype=torch.long), req_pool_indices=torch.tensor([1, 2]),
            seq_lens=torch.tensor(lens), seq_lens_cpu=lens, out_cache_loc=torch.arange(total),
            extend_seq_lens=torch.tensor(lens), extend_start_loc=torch.tensor(locs),
            extend_seq_lens_cpu=lens, extend_prefix_lens_cpu=[0, 0], return_logprob=True,
            extend_logprob_start_lens_cpu=starts, extend_input_logprob_token_ids=targets,
            top_logprobs_nums=[3, 2])

    # The oracle: every position at once, straight from the definition.
    logprobs = (hidden @ head.weight.t()).float().log_softmax(-1)
    rows = torch.cat([torch.arange(loc + s, loc + n) for loc, s, n in zip(locs, starts, lens)])
    expected = logprobs[rows].gather(1, targets.unsqueeze(1)).squeeze(1)

    chunk = 16
    lp = LogitsProcessor(cfg)
    monkeypatch.setattr(lp, "input_logprob_chunk_size", chunk, raising=False)
    projected_rows = []
    compute_logits = lp.compute_logits

    def recording(hidden_states, lm_head):
        projected_rows.append(hidden_states.shape[0])
        return compute_logits(hidden_states, lm_head)

    monkeypatch.setattr(lp, "compute_logits", recording)
    out = lp(batch().input_ids, hidden, head, batch())
    input_positions = rows.numel()
    assert max(projected_rows) <= chunk  # never the whole [positions, vocab] matrix
    assert sum(projected_rows) == input_positions + 2  # + the last position of each request
    assert torch.allclose(out.input_token_logprobs, expected, atol=1e-5)
    offset = 0
    for i, (s, n, k) in enumerate(zip(starts, lens, [3, 2])):
        top = logprobs[rows[offset : offset + n - s]].topk(k)
        assert out.input_top_logprobs_idx[i] == top.indices.tolist()
        assert torch.allclose(torch.tensor(out.input_top_logprobs_val[i]), top.values, atol=1e-5)
        offset += n - s

    one_shot = LogitsProcessor(cfg)
    monkeypatch.setattr(one_shot, "input_logprob_chunk_size", 10 ** 6, raising=False)
    whole = one_shot(batch().input_ids, hidden, head, batch())
    assert torch.allclose(whole.input_token_logprobs, out.input_token_logprobs, atol=1e-6)
    assert whole.input_top_logprobs_idx == out.input_top_logprobs_idx


def test_prepacked_linear_matches_plain_linear():
    from engine.layers.linear import prepack_linear_weights
    from engine.model_loader.weight_utils import clear_packed_weights

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    torch.manual_seed(0)
    model = torch.nn.Sequential(ColumnParallelLinear(32, 48, bias=True), RowParallelLinear(48, 16, bias=False))
    for p in model.parameters():
        p.data.normal_()
    x = torch.randn(5, 32)
    ref = model(x)
    assert prepack_linear_weights(model) == 2
    assert model[0].packed_weight is not None
    assert torch.allclose(model(x), ref, atol=1e-4)
    big = torch.randn(600, 32)  # above PACKED_MAX_ROWS: the plain path
    assert torch.allclose(model(torch.cat([x, big]))[:5], ref, atol=1e-4)
    clear_packed_weights(model)
    assert model[0].packed_weight is None


def test_torch_native_padded_extend_batch_matches_reference():
    import engine.layers.attention.torch_native_backend as backend_mod

    torch.manual_seed(1)
    heads, kv_heads, d = 4, 2, 8
    pool, table = _make_pool(kv_heads=kv_heads, head_dim=d)
    layer = RadixAttention(heads, d, 1 / math.sqrt(d), kv_heads, layer_id=0)
    lens = [5, 6, 4]  # similar lengths, no prefixes: the batched padded path
    slots = [list(range(1, 6)), list(range(10, 16)), list(range(20, 24))]
    for row, s in enumerate(slots, start=1):
        table.req_to_token[row, : len(s)] = torch.tensor(s, dtype=torch.int32)
    fb = _batch(ForwardMode.EXTEND, [1, 2, 3], lens, sum(slots, []), pool, table, [0, 0, 0], lens)
    assert isinstance(fb.attn_metadata, backend_mod._PaddedExtend)
    q, k, v = torch.randn(15, heads, d), torch.randn(15, kv_heads, d), torch.randn(15, kv_heads, d)
    out = layer(q.reshape(15, -1), k.reshape(15, -1), v.reshape(15, -1), fb).view(15, heads, d)
    start = 0
    for n in lens:
        ref = _reference_attention(q[start : start + n], k[start : start + n], v[start : start + n], layer.scaling, 0)
        assert torch.allclose(out[start : start + n], ref, atol=1e-5)
        start += n
    # Very uneven lengths fall back to one SDPA per request.
    fb = _batch(ForwardMode.EXTEND, [1, 2], [1, 6], [1, 10, 11, 12, 13, 14, 15], pool, table, [0, 0], [1, 6])
    assert isinstance(fb.attn_metadata, list)


def _require_cpu_kernel() -> None:
    """The native kernel must build wherever a C compiler is (it is optional without one)."""
    from engine.kernels import library

    if library.attention() is None:
        if not library.switches()[library.Family.ATTENTION] or not (shutil.which("gcc") or shutil.which("cc")):
            pytest.skip("the native CPU kernel is off or there is no C compiler")
        pytest.fail("a C compiler is present but the CPU decode kernel did not build (see the log)")


@pytest.fixture(params=["native-kernel", "portable-kernel", "torch-gather"])
def decode_path(request, monkeypatch):
    """Run a decode test through the native CPU kernel (as built for this CPU, and the portable
    build: conftest.kernel_build) and through the pure-torch gather path."""
    from engine.kernels import attention as attention_kernels
    from engine.kernels import library

    if request.param == "native-kernel":
        _require_cpu_kernel()
    elif request.param == "portable-kernel":
        monkeypatch.setattr(library, "_kernel", request.getfixturevalue("portable_kernels"))
    else:
        monkeypatch.setattr(attention_kernels, "supports", lambda q, k_buf: False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_native_decode_cascade_over_shared_prefixes_matches_reference(monkeypatch, dtype, decode_path):
    """Requests whose KV starts with the same pool slots (a radix-shared prefix) decode as a
    cascade: the prefix is read once per group and merged with each request's suffix by LSE."""
    import engine.layers.attention.torch_native_backend as backend_mod

    torch.manual_seed(2)
    heads, kv_heads, d = 6, 2, 16
    pool = MHATokenToKVPool(1024, 1, dtype, kv_heads, d, layer_num=1)
    table = ReqToTokenPool(8, 256)
    layer = RadixAttention(heads, d, 1 / math.sqrt(d), kv_heads, layer_id=0)
    pool.set_kv_buffer(0, torch.arange(1024), torch.randn(1024, kv_heads, d).to(dtype),
                       torch.randn(1024, kv_heads, d).to(dtype))
    shared_a = list(range(100, 180))  # 80 slots shared by rows 1-3
    shared_b = list(range(300, 370))  # 70 slots shared by rows 4-5, which then share 5 more
    rows = {
        1: shared_a + [500, 501],
        2: shared_a + list(range(600, 620)),
        3: shared_a + [700],
        4: shared_b + [800, 801, 802, 803, 804, 810],
        5: shared_b + [800, 801, 802, 803, 804, 820, 821],
        6: list(range(900, 990)),  # shares nothing
        7: shared_a[:10] + list(range(940, 1010)),  # begins like rows 1-3, shares only 10 slots
    }
    for row, slots in rows.items():
        table.req_to_token[row, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
        table.req_to_token[row, len(slots):] = 1000 + row  # stale entries past the length
    order = [3, 6, 1, 4, 7, 2, 5]
    seq_lens = [len(rows[r]) for r in order]
    out_loc = [rows[r][-1] for r in order]
    bs = len(order)
    q = torch.randn(bs, heads * d).to(dtype)
    k_new = pool.k_buffer[0][torch.tensor(out_loc)].reshape(bs, -1)
    v_new = pool.v_buffer[0][torch.tensor(out_loc)].reshape(bs, -1)

    def decode():
        fb = _batch(ForwardMode.DECODE, order, seq_lens, out_loc, pool, table)
        return fb.attn_metadata, layer(q, k_new, v_new, fb).view(bs, heads, d).float()

    meta, out = decode()
    groups = sorted((sorted(order[i] for i in g.members.tolist()), g.kv_indices.numel()) for g in meta.shared)
    assert groups == [([1, 2, 3], 80), ([4, 5], 75)]
    monkeypatch.setattr(backend_mod, "MIN_SHARED_PREFIX", 10**6)
    plain_meta, plain = decode()
    assert plain_meta.shared == []
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for i, row in enumerate(order):
        slots = torch.tensor(rows[row])
        ref = _reference_attention(q[i : i + 1].view(1, heads, d).float(), pool.k_buffer[0][slots].float(),
                                   pool.v_buffer[0][slots].float(), layer.scaling, len(rows[row]) - 1)
        assert torch.allclose(out[i], ref[0], atol=tol), row
        assert torch.allclose(out[i], plain[i], atol=tol), row


def _reference_decode(q_row, k_rows, v_rows, heads, dim, scale):
    """One request's decode attention in float64; k_rows/v_rows [n, kv_heads, dim]."""
    group = heads // k_rows.shape[1]
    k = k_rows.double().repeat_interleave(group, 1)
    v = v_rows.double().repeat_interleave(group, 1)
    scores = torch.einsum("hd,nhd->hn", q_row.view(heads, dim).double(), k) * scale
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 32), (8, 2, 64), (12, 4, 128), (6, 2, 24)])
@pytest.mark.parametrize("bs", [1, 3, 9])
@pytest.mark.parametrize("layout", ["scattered", "consecutive"])  # consecutive: tiles read in one pass first
def test_cpu_decode_kernel_matches_reference(kernel_build, dtype, heads, kv_heads, dim, bs, layout):
    """Lengths from 1 to past two 128-key softmax tiles, and ragged 16-key score blocks."""
    from engine.kernels import attention as attention_kernels

    _require_cpu_kernel()
    torch.manual_seed(bs + heads + dim)
    slots = 400
    k_buf = torch.randn(slots, kv_heads, dim).to(dtype)
    v_buf = torch.randn(slots, kv_heads, dim).to(dtype)
    lens = torch.randint(1, 300, (bs,))
    lens[0] = 1
    kv_indices = torch.randint(0, slots, (bs, int(lens.max())))
    if layout == "consecutive":  # each request's slots in order from a random start, wrapping around
        kv_indices = (kv_indices[:, :1] + torch.arange(kv_indices.shape[1])) % slots
    q = torch.randn(bs, heads * dim).to(dtype)
    scale = 1 / math.sqrt(dim)
    out = attention_kernels.decode_attention(q, k_buf, v_buf, kv_indices, lens, heads, kv_heads, dim, scale)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b in range(bs):
        idx = kv_indices[b, : lens[b]]
        ref = _reference_decode(q[b], k_buf[idx], v_buf[idx], heads, dim, scale)
        assert torch.allclose(out[b].view(heads, dim).double(), ref, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(16, 8, 64), (12, 4, 128)])
def test_cpu_decode_kernel_cascade_matches_reference(cpu_isa, dtype, heads, kv_heads, dim):
    """Groups read their shared prefix once (phase 1) and each member continues over its own suffix."""
    from engine.kernels import attention as attention_kernels

    _require_cpu_kernel()
    if dtype == torch.float32 and cpu_isa == "amx":
        pytest.skip("float32 never reaches the AMX tiles: the avx512 variant covers it")
    torch.manual_seed(heads + dim)
    slots, bs = 2000, 7
    k_buf = torch.randn(slots, kv_heads, dim).to(dtype)
    v_buf = torch.randn(slots, kv_heads, dim).to(dtype)
    prefixes = [torch.randperm(slots)[:300], torch.randperm(slots)[:77]]
    group_of = torch.tensor([0, -1, 1, 0, 0, -1, 1])
    lens = torch.tensor([1, 200, 5, 130, 17, 1, 40])
    kv_indices = torch.randint(0, slots, (bs, int(lens.max())))
    cascade = attention_kernels.CascadeTables(
        group_offsets=torch.tensor([0, 3, 5]), members=torch.tensor([0, 3, 4, 2, 6]),
        prefix_indices=torch.stack([prefixes[0], torch.cat([prefixes[1], torch.zeros(223, dtype=torch.long)])]),
        prefix_lens=torch.tensor([300, 77]), group_of=group_of)
    q = torch.randn(bs, heads * dim).to(dtype)
    scale = 1 / math.sqrt(dim)
    out = attention_kernels.decode_attention(q, k_buf, v_buf, kv_indices, lens, heads, kv_heads, dim, scale,
                                       cascade=cascade)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b in range(bs):
        own = kv_indices[b, : lens[b]]
        idx = own if group_of[b] < 0 else torch.cat([prefixes[int(group_of[b])], own])
        ref = _reference_decode(q[b], k_buf[idx], v_buf[idx], heads, dim, scale)
        assert torch.allclose(out[b].view(heads, dim).double(), ref, atol=tol), b


@pytest.mark.parametrize("heads,kv_heads,dim,members,prefix_len", [(16, 8, 64, 20, 601), (12, 4, 128, 11, 256),
                                                                    (8, 8, 32, 40, 13)])
def test_cpu_decode_kernel_cascade_large_groups(cpu_isa, heads, kv_heads, dim, members, prefix_len):
    """bf16 phase 1 with more than 32 query rows per KV head (several row blocks), prefixes across
    softmax tiles and ragged key blocks, beside a request outside any group."""
    from engine.kernels import attention as attention_kernels

    _require_cpu_kernel()
    torch.manual_seed(members + dim)
    slots, bs = 4000, members + 1
    k_buf = torch.randn(slots, kv_heads, dim).to(torch.bfloat16)
    v_buf = torch.randn(slots, kv_heads, dim).to(torch.bfloat16)
    prefix = torch.randperm(slots)[:prefix_len]
    group_of = torch.tensor([0] * members + [-1])
    lens = torch.randint(1, 40, (bs,))
    kv_indices = torch.randint(0, slots, (bs, int(lens.max())))
    cascade = attention_kernels.CascadeTables(
        group_offsets=torch.tensor([0, members]), members=torch.arange(members), prefix_indices=prefix[None],
        prefix_lens=torch.tensor([prefix_len]), group_of=group_of)
    q = torch.randn(bs, heads * dim).to(torch.bfloat16)
    scale = 1 / math.sqrt(dim)
    out = attention_kernels.decode_attention(q, k_buf, v_buf, kv_indices, lens, heads, kv_heads, dim, scale,
                                       cascade=cascade)
    for b in range(bs):
        own = kv_indices[b, : lens[b]]
        idx = own if group_of[b] < 0 else torch.cat([prefix, own])
        ref = _reference_decode(q[b], k_buf[idx], v_buf[idx], heads, dim, scale)
        assert torch.allclose(out[b].view(heads, dim).double(), ref, atol=2e-2), b


@pytest.mark.parametrize("heads,kv_heads,dim", [(16, 8, 64), (4, 4, 32), (12, 4, 128), (6, 2, 24)])
def test_native_bf16_extend_kernel_matches_reference(monkeypatch, cpu_isa, heads, kv_heads, dim):
    """bf16 prefills through the native kernels: requests with and without a cached prefix, long
    enough for several key panels and query-row blocks, a one-token row (as the decode rows of a
    MIXED batch), and the same batch through the torch path."""
    from engine.kernels import attention as attention_kernels

    _require_cpu_kernel()
    if not attention_kernels.extend_supported():
        pytest.skip("no AVX512-BF16 on this CPU: bf16 prefills keep the torch path")
    torch.manual_seed(heads + dim)
    slots = 1200
    pool = MHATokenToKVPool(slots, 1, torch.bfloat16, kv_heads, dim, layer_num=1)
    table = ReqToTokenPool(5, 512)
    layer = RadixAttention(heads, dim, 1 / math.sqrt(dim), kv_heads, layer_id=0)
    pool.set_kv_buffer(0, torch.arange(slots), torch.randn(slots, kv_heads, dim).to(torch.bfloat16),
                       torch.randn(slots, kv_heads, dim).to(torch.bfloat16))
    prefix_lens, ext_lens = [0, 150, 300, 300], [133, 70, 1, 1]
    perm = torch.randperm(slots - 1) + 1
    req_slots, out_loc, start = [], [], 0
    for row, (p, e) in enumerate(zip(prefix_lens, ext_lens), start=1):
        s = perm[start:start + p + e]
        start += p + e
        if row == 4:  # shares request 3's 300 cached slots: a cascade group in the decode kernel
            s = torch.cat([req_slots[2][:300], s[300:]])
        table.req_to_token[row, : p + e] = s.int()
        req_slots.append(s)
        out_loc += s[p:].tolist()
    total = sum(ext_lens)
    q = torch.randn(total, heads * dim).to(torch.bfloat16)
    k_new = pool.k_buffer[0][torch.tensor(out_loc)].reshape(total, -1)
    v_new = pool.v_buffer[0][torch.tensor(out_loc)].reshape(total, -1)
    seq_lens = [p + e for p, e in zip(prefix_lens, ext_lens)]

    def run():
        fb = _batch(ForwardMode.EXTEND, [1, 2, 3, 4], seq_lens, out_loc, pool, table, prefix_lens, ext_lens)
        return fb.attn_metadata, layer(q, k_new, v_new, fb).view(total, heads, dim).float()

    import engine.layers.attention.torch_native_backend as backend_mod

    meta, out = run()
    # the two multi-token requests through the extend kernel, the one-token one through the decode kernel
    assert isinstance(meta, backend_mod._NativeExtend) and meta.extend.ext_lens.tolist() == [133, 70]
    assert meta.decode_rows.tolist() == [203, 204] and len(meta.decode.shared) == 1
    monkeypatch.setattr(attention_kernels, "extend_supported", lambda: False)
    torch_meta, torch_out = run()
    assert not isinstance(torch_meta, backend_mod._NativeExtend)
    row0 = 0
    for s, p, e in zip(req_slots, prefix_lens, ext_lens):
        ref = _reference_attention(q[row0:row0 + e].view(e, heads, dim).double(), pool.k_buffer[0][s].double(),
                                   pool.v_buffer[0][s].double(), layer.scaling, p)
        assert torch.allclose(out[row0:row0 + e].double(), ref, atol=2e-2)
        assert torch.allclose(out[row0:row0 + e], torch_out[row0:row0 + e], atol=3e-2)
        row0 += e
