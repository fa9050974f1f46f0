"""Embedding models through ModelRunner against transformers on tiny random weights: the BERT
encoder (bidirectional attention, mean/CLS/last pooling), decoders served with last-token pooling
(--is-embedding, and bare *Model checkpoints), Matryoshka truncation, the pooling config read
from sentence-transformers files, and which models count as embedding models."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine.configs.model_config import ModelConfig
from engine.configs.pooling_config import PoolingType, resolve_pooling
from engine.layers.attention.torch_native_backend import TorchNativeAttnBackend, _PaddedExtend
from engine.layers.pooler import Pooler
from engine.layers.radix_attention import AttentionType, RadixAttention
from engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from utils_models import BatchDriver, ExtendReq, build_tiny_bert, build_tiny_model, hf_hidden_states, make_runner

COS_MIN = 0.99999


def _prompts(lengths, seed=5, vocab=512):
    gen = torch.Generator().manual_seed(seed)
    return [[int(x) for x in torch.randint(0, vocab, (n,), generator=gen)] for n in lengths]


def embed(runner, prompts, prefix_lens=None, dimensions=None):
    """One EXTEND batch of the prompts (on top of already computed prefixes when given)."""
    driver = BatchDriver(runner, seed=1)
    rows = [driver.new_row() for _ in prompts]
    prefix_lens = prefix_lens or [0] * len(prompts)
    first = [ExtendReq(r, p[:k]) for r, p, k in zip(rows, prompts, prefix_lens) if k > 0]
    if first:
        runner.forward_embedding(driver.extend_batch(first))
    fb = driver.extend_batch([ExtendReq(r, p[k:], prefix_len=k) for r, p, k in zip(rows, prompts, prefix_lens)])
    fb.dimensions = dimensions
    return runner.forward_embedding(fb).embeddings


def pooled(hidden: torch.Tensor, mode: str) -> torch.Tensor:
    vec = {"mean": hidden.mean(0), "cls": hidden[0], "lasttoken": hidden[-1]}[mode]
    return F.normalize(vec, dim=-1)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    cos = F.cosine_similarity(got.double(), want.double(), dim=-1)
    assert float(cos.min()) >= COS_MIN, cos
    assert torch.allclose(got, want, atol=2e-5), (got - want).abs().max()


# ---------------------------------------------------------------------------- BERT
@pytest.mark.parametrize("mode", ["mean", "cls", "lasttoken"])
def test_bert_matches_transformers(tmp_path, mode):
    hf = build_tiny_bert(str(tmp_path), pooling_mode=mode)
    runner = make_runner(str(tmp_path))
    config = runner.model_config
    assert not config.is_generation and config.is_encoder_only
    assert config.pooling.pooling_type.name.lower() == {"lasttoken": "last"}.get(mode, mode)
    # Lengths 1 .. 100 in one batch (per-request attention), then similar lengths (one padded SDPA).
    for lengths in ([1, 7, 30, 100, 64], [20, 22, 25, 21]):
        prompts = _prompts(lengths, seed=len(lengths))
        want = torch.stack([pooled(hf_hidden_states(hf, p), mode) for p in prompts])
        assert_close(embed(runner, prompts), want)


def test_bert_padded_extend_masks_padding_keys(tmp_path):
    """The padded path is taken for close lengths, and a short input is unaffected by the padding
    that its neighbours cause (it equals the input embedded alone)."""
    build_tiny_bert(str(tmp_path), pooling_mode="mean")
    runner = make_runner(str(tmp_path))
    prompts = _prompts([30, 26, 28])
    driver = BatchDriver(runner)
    rows = [driver.new_row() for _ in prompts]
    fb = driver.extend_batch([ExtendReq(r, p) for r, p in zip(rows, prompts)])
    batch = runner.forward_embedding(fb).embeddings
    assert isinstance(fb.attn_metadata, _PaddedExtend)
    alone = torch.cat([embed(runner, [p]) for p in prompts])
    assert_close(batch, alone)


def test_default_bert_pooling_is_normalised_cls(tmp_path):
    """Without sentence-transformers files a BertModel gets SGLang's default: CLS, normalised."""
    hf = build_tiny_bert(str(tmp_path))
    runner = make_runner(str(tmp_path))
    assert runner.model_config.pooling.source == "default"
    prompts = _prompts([9, 17])
    assert_close(embed(runner, prompts), torch.stack([pooled(hf_hidden_states(hf, p), "cls") for p in prompts]))


def test_encoder_kv_pool_is_a_token_budget(tmp_path):
    build_tiny_bert(str(tmp_path), pooling_mode="mean")
    runner = make_runner(str(tmp_path), max_total_tokens=None, page_size=16, max_prefill_tokens=1000)
    # Two batches of --max-prefill-tokens plus one context-long input each; no K/V buffer but page 0.
    assert runner.max_total_num_tokens == 2 * (1000 + 128) // 16 * 16
    assert runner.token_to_kv_pool.k_buffer[0].shape[0] == 16


# ---------------------------------------------------------------------------- decoders
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_decoder_last_token_pooling_matches_transformers(tmp_path, arch):
    hf = build_tiny_model(str(tmp_path), arch)
    runner = make_runner(str(tmp_path), is_embedding=True, page_size=4)
    config = runner.model_config
    assert not config.is_generation and not config.is_encoder_only
    assert config.pooling.pooling_type == PoolingType.LAST and config.pooling.normalize
    prompts = _prompts([1, 9, 40, 23])
    want = torch.stack([pooled(hf_hidden_states(hf, p), "lasttoken") for p in prompts])
    assert_close(embed(runner, prompts), want)
    # On top of cached prefixes (the radix cache's case): the same vectors.
    assert_close(embed(runner, prompts, prefix_lens=[0, 8, 33, 4]), want)


def test_bare_decoder_checkpoint_embeds(tmp_path):
    """A Qwen3Model checkpoint (no LM head, weights named without `model.`) is an embedding model
    by its architecture alone."""
    import transformers

    from utils_models import TINY, _randomize

    config = transformers.Qwen3Config(**TINY, head_dim=16)
    hf = transformers.Qwen3Model(config).to(torch.float32)
    _randomize(hf, 3)
    hf.eval().save_pretrained(str(tmp_path))
    assert json.load(open(tmp_path / "config.json"))["architectures"] == ["Qwen3Model"]
    runner = make_runner(str(tmp_path))
    assert not runner.model_config.is_generation
    prompts = _prompts([5, 31])
    assert_close(embed(runner, prompts), torch.stack([pooled(hf_hidden_states(hf, p), "lasttoken") for p in prompts]))


def test_matryoshka_dimensions_truncate_then_normalise(tmp_path):
    build_tiny_model(str(tmp_path), "llama")
    runner = make_runner(str(tmp_path), is_embedding=True)
    prompts = _prompts([6, 13, 21])
    full = embed(runner, prompts)
    same = embed(runner, prompts, dimensions=[16, 16, 16])
    assert isinstance(same, torch.Tensor) and same.shape == (3, 16)
    assert_close(same, F.normalize(full[:, :16], dim=-1))
    mixed = embed(runner, prompts, dimensions=[8, None, 32])
    assert [v.shape[0] for v in mixed] == [8, 64, 32]
    for vec, row, dim in zip(mixed, full, [8, 64, 32]):
        assert_close(vec, F.normalize(row[:dim], dim=-1))


def test_pooler_without_normalisation_keeps_the_scale():
    fb = SimpleNamespace(extend_start_loc=torch.tensor([0, 2]), extend_seq_lens=torch.tensor([2, 3]), dimensions=None)
    hidden = torch.arange(5 * 4, dtype=torch.float32).view(5, 4)
    out = Pooler(PoolingType.MEAN, normalize=False)(hidden, fb).embeddings
    assert torch.equal(out, torch.stack([hidden[:2].mean(0), hidden[2:].mean(0)]))
    fb.dimensions = [3, 3]
    assert torch.equal(Pooler(PoolingType.CLS, normalize=False)(hidden, fb).embeddings, hidden[[0, 2], :3])


# ---------------------------------------------------------------------------- configuration
def _write_st(path, pooling_config, modules=("Transformer", "Pooling", "Normalize"), max_seq_length=None):
    entries = [{"idx": i, "name": str(i), "path": "1_Pooling" if m == "Pooling" else "",
                "type": f"sentence_transformers.models.{m}"} for i, m in enumerate(modules)]
    (path / "modules.json").write_text(json.dumps(entries))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    if max_seq_length is not None:
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))


def test_pooling_config_from_sentence_transformers_files(tmp_path):
    legacy = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False}
    _write_st(tmp_path, legacy)
    config = resolve_pooling(str(tmp_path), is_causal=False)
    assert (config.pooling_type, config.normalize) == (PoolingType.MEAN, True)
    _write_st(tmp_path, {"pooling_mode": "lasttoken"}, modules=("Transformer", "Pooling"))
    config = resolve_pooling(str(tmp_path), is_causal=True)
    assert (config.pooling_type, config.normalize) == (PoolingType.LAST, False)
    _write_st(tmp_path, {"pooling_mode": "max"})
    with pytest.raises(ValueError, match="'max'.*not supported"):
        resolve_pooling(str(tmp_path), is_causal=False)
    _write_st(tmp_path, {"pooling_mode": "mean"}, modules=("Transformer", "Pooling", "Dense", "Normalize"))
    with pytest.raises(ValueError, match="Dense"):
        resolve_pooling(str(tmp_path), is_causal=False)


def test_which_models_embed(tmp_path):
    llama, bert, st_llama = tmp_path / "llama", tmp_path / "bert", tmp_path / "st_llama"
    build_tiny_model(str(llama), "llama")
    build_tiny_model(str(st_llama), "llama")
    _write_st(st_llama, {"pooling_mode": "lasttoken"}, max_seq_length=100)
    build_tiny_bert(str(bert), pooling_mode="mean")
    assert ModelConfig.from_pretrained(str(llama), device="cpu").is_generation
    flagged = ModelConfig.from_pretrained(str(llama), device="cpu", is_embedding=True)
    assert not flagged.is_generation and flagged.pooling.pooling_type == PoolingType.LAST
    assert flagged.context_len == 256 and not flagged.is_matryoshka
    st = ModelConfig.from_pretrained(str(st_llama), device="cpu")
    assert not st.is_generation and st.context_len == 100  # sentence_bert_config's max_seq_length
    encoder = ModelConfig.from_pretrained(str(bert), device="cpu")
    assert not encoder.is_generation and encoder.is_encoder_only
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelConfig.from_pretrained(str(bert), device="cpu", context_length=129)
    raw = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**raw, "is_matryoshka": True, "matryoshka_dimensions": [16, 32]}))
    matryoshka = ModelConfig.from_pretrained(str(llama), device="cpu", is_embedding=True)
    assert matryoshka.is_matryoshka and matryoshka.matryoshka_dimensions == [16, 32]
    (llama / "config.json").write_text(json.dumps({**raw, "architectures": ["LlamaForSequenceClassification"]}))
    with pytest.raises(ValueError, match="classification/reward head"):
        ModelConfig.from_pretrained(str(llama), device="cpu")


# ---------------------------------------------------------------------------- attention
def _reference(q, k, v, scale, causal):
    """q [E, H, D], k/v [E, KH, D] (float64)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("ehd,shd->hes", q.double(), k) * scale
    if causal:
        n = q.shape[0]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hes,shd->ehd", scores.softmax(-1), v)


@pytest.mark.parametrize("lengths", [[5, 40, 1], [12, 10, 11]])  # per-request / padded SDPA
def test_torch_native_encoder_attention_sees_its_whole_input(lengths):
    heads, kv_heads, head_dim = 4, 2, 16
    gen = torch.Generator().manual_seed(sum(lengths))
    total = sum(lengths)
    ext = torch.tensor(lengths)
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=len(lengths), input_ids=torch.zeros(total, dtype=torch.int64),
        positions=torch.zeros(total, dtype=torch.int64), req_pool_indices=torch.arange(1, len(lengths) + 1),
        seq_lens=ext, seq_lens_cpu=list(lengths), out_cache_loc=torch.arange(1, total + 1), seq_lens_sum=total,
        extend_num_tokens=total, extend_seq_lens=ext, extend_prefix_lens=torch.zeros_like(ext),
        extend_start_loc=torch.cumsum(ext, 0) - ext, extend_seq_lens_cpu=list(lengths),
        extend_prefix_lens_cpu=[0] * len(lengths),
        req_to_token_pool=ReqToTokenPool(size=4, max_context_len=64),
        token_to_kv_pool=MHATokenToKVPool(size=0, page_size=1, dtype=torch.float32, head_num=kv_heads,
                                          head_dim=head_dim, layer_num=1),
    )
    backend = TorchNativeAttnBackend(SimpleNamespace(device="cpu"))
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    assert isinstance(fb.attn_metadata, _PaddedExtend) == (lengths == [12, 10, 11])
    scale = 1 / math.sqrt(head_dim)
    q = torch.randn(total, heads * head_dim, generator=gen)
    k = torch.randn(total, kv_heads * head_dim, generator=gen)
    v = torch.randn(total, kv_heads * head_dim, generator=gen)
    for attn_type, causal in ((AttentionType.ENCODER_ONLY, False), (AttentionType.DECODER, True)):
        layer = RadixAttention(heads, head_dim, scale, kv_heads, layer_id=0, attn_type=attn_type)
        out = layer(q, k, v, fb, save_kv_cache=False).view(total, heads, head_dim)
        start = 0
        for n in lengths:
            rows = slice(start, start + n)
            want = _reference(q[rows].view(n, heads, head_dim), k[rows].view(n, kv_heads, head_dim),
                              v[rows].view(n, kv_heads, head_dim), scale, causal)
            assert torch.allclose(out[rows].double(), want, atol=1e-5), (attn_type, n)
            start += n
