"""ModelRunner end to end on the paged pool: incremental greedy decoding vs transformers,
cached prefixes, MIXED batches, and KV pool sizing."""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

from utils_models import BatchDriver, ExtendReq, build_tiny_model, hf_greedy, make_runner

DECODE_STEPS = 32


def _prompts(lengths):
    gen = torch.Generator().manual_seed(7)
    return [[int(x) for x in torch.randint(0, 512, (n,), generator=gen)] for n in lengths]


PROMPTS = _prompts([5, 23, 17, 40])


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    hf = build_tiny_model(str(path), "llama")
    expected = [hf_greedy(hf, p, DECODE_STEPS + 1) for p in PROMPTS]
    return str(path), expected


def _generate(runner, prompts, cached_prefix_lens=None, scramble=False):
    """Prefill (optionally on top of an already computed prefix) then DECODE_STEPS decodes."""
    driver = BatchDriver(runner, seed=3, scramble=scramble)
    rows = [driver.new_row() for _ in prompts]
    if cached_prefix_lens is not None:
        # First put the prefixes in the pool, as an earlier request sharing them would have.
        first = [ExtendReq(r, p[:k]) for r, p, k in zip(rows, prompts, cached_prefix_lens) if k > 0]
        driver.run(driver.extend_batch(first))
        reqs = [ExtendReq(r, p[k:], prefix_len=k) for r, p, k in zip(rows, prompts, cached_prefix_lens)]
    else:
        reqs = [ExtendReq(r, p) for r, p in zip(rows, prompts)]
    _, tokens = driver.run(driver.extend_batch(reqs))
    outputs = [[int(t)] for t in tokens]
    seq_lens = [len(p) for p in prompts]
    for _ in range(DECODE_STEPS):
        fb = driver.decode_batch(rows, [o[-1] for o in outputs], seq_lens)
        _, tokens = driver.run(fb)
        seq_lens = [n + 1 for n in seq_lens]
        for o, t in zip(outputs, tokens):
            o.append(int(t))
    return outputs


@pytest.mark.parametrize("page_size,scramble", [(1, False), (16, False), (16, True)])
def test_greedy_decoding_matches_transformers(tiny_llama, page_size, scramble):
    path, expected = tiny_llama
    runner = make_runner(path, page_size=page_size)
    assert runner.max_total_num_tokens % page_size == 0
    assert _generate(runner, PROMPTS, scramble=scramble) == expected


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_decoding_on_cached_prefix(tiny_llama, page_size):
    path, expected = tiny_llama
    runner = make_runner(path, page_size=page_size)
    # Prefixes of several lengths, including one past a page boundary and a whole-prompt-but-one.
    assert _generate(runner, PROMPTS, cached_prefix_lens=[4, 18, 0, 33]) == expected


def test_mixed_batch_equals_separate_extend_and_decode(tiny_llama):
    path, _ = tiny_llama
    prefill_first, prefill_later = PROMPTS[:2], PROMPTS[2:]

    def run(mixed: bool):
        runner = make_runner(path, page_size=1)
        driver = BatchDriver(runner, seed=5)
        rows = [driver.new_row() for _ in PROMPTS]
        out, tokens = driver.run(driver.extend_batch([ExtendReq(r, p) for r, p in zip(rows[:2], prefill_first)]))
        decode_rows = [(r, int(t), len(p)) for r, t, p in zip(rows[:2], tokens, prefill_first)]
        new_reqs = [ExtendReq(r, p) for r, p in zip(rows[2:], prefill_later)]
        if mixed:
            fb = driver.extend_batch(new_reqs, decode_rows=decode_rows)
            assert fb.forward_mode.is_mixed()
            out, tokens = driver.run(fb)
            return out.next_token_logits, tokens.tolist()
        ext_out, ext_tokens = driver.run(driver.extend_batch(new_reqs))
        dec_out, dec_tokens = driver.run(driver.decode_batch([d[0] for d in decode_rows], [d[1] for d in decode_rows], [d[2] for d in decode_rows]))
        return torch.cat([ext_out.next_token_logits, dec_out.next_token_logits]), ext_tokens.tolist() + dec_tokens.tolist()

    mixed_logits, mixed_tokens = run(True)
    sep_logits, sep_tokens = run(False)
    assert mixed_logits.shape == (4, 512)
    assert mixed_tokens == sep_tokens
    assert (mixed_logits - sep_logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_extend_runs_the_last_layer_past_attention_on_the_sampled_rows_only(tiny_llama, monkeypatch, dtype):
    """Of an extend (here MIXED) batch only each request's last row feeds the logits, so the last
    layer attends from those rows alone (bf16 on the CPU: through the decode kernel) and runs its
    output projection and MLP on them; the logits are those of the full run."""
    from engine.kernels import attention as attention_kernels
    from engine.layers.logits_processor import LogitsProcessor

    path, _ = tiny_llama
    decode_kernel_rows = []
    decode_attention = attention_kernels.decode_attention

    def counting(q, *args, **kwargs):
        decode_kernel_rows.append(q.shape[0])
        return decode_attention(q, *args, **kwargs)

    def run(prune: bool):
        monkeypatch.setattr(attention_kernels, "decode_attention", counting)
        if not prune:
            monkeypatch.setattr(LogitsProcessor, "last_rows_suffice", staticmethod(lambda fb: False))
        runner = make_runner(path, page_size=1, dtype=dtype)
        rows_seen = []
        for layer in runner.model.model.decoder_layers:
            layer.mlp.register_forward_hook(lambda mod, args, out: rows_seen.append(args[0].shape[0]))
        driver = BatchDriver(runner, seed=5)
        rows = [driver.new_row() for _ in PROMPTS]
        _, tokens = driver.run(driver.extend_batch([ExtendReq(r, p) for r, p in zip(rows[:2], PROMPTS[:2])]))
        decode_rows = [(r, int(t), len(p)) for r, t, p in zip(rows[:2], tokens, PROMPTS[:2])]
        rows_seen.clear()
        decode_kernel_rows.clear()
        fb = driver.extend_batch([ExtendReq(r, p) for r, p in zip(rows[2:], PROMPTS[2:])], decode_rows=decode_rows)
        out, tokens = driver.run(fb)
        monkeypatch.undo()
        return out.next_token_logits, tokens.tolist(), rows_seen, list(decode_kernel_rows)

    logits, tokens, rows_seen, kernel_rows = run(True)
    full_logits, full_tokens, full_rows_seen, full_kernel_rows = run(False)
    total = len(PROMPTS[2]) + len(PROMPTS[3]) + 2
    assert full_rows_seen == [total, total] and rows_seen == [total, 4]
    if dtype == "bfloat16" and attention_kernels.extend_supported():
        # Layer 0: the 2 decode rows; layer 1 (the last): the 4 requests' last rows, a decode batch.
        assert full_kernel_rows == [2, 2] and kernel_rows == [2, 4]
    assert tokens == full_tokens
    tolerance = 1e-5 if dtype == "float32" else 1e-2 * full_logits.abs().max().item()  # bf16: its rounding
    assert (logits - full_logits).abs().max().item() <= tolerance


def test_pool_sizing_and_attributes(tiny_llama, caplog):
    path, _ = tiny_llama
    with caplog.at_level(logging.INFO, logger="engine.model_executor.model_runner"):
        runner = make_runner(path, page_size=16, max_total_tokens=1000)
    assert runner.max_total_num_tokens == 992  # rounded down to a page multiple
    assert runner.token_to_kv_pool.size == 992
    assert runner.token_to_kv_pool.k_buffer[0].shape == (992 + 16, 2, 16)
    assert len(runner.token_to_kv_pool.k_buffer) == 2
    assert runner.req_to_token_pool.req_to_token.shape == (16 + 1, 256)
    assert runner.dtype == torch.float32 and runner.device == "cpu"
    from engine.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

    assert isinstance(runner.token_to_kv_pool_allocator, PagedTokenToKVPoolAllocator)
    assert runner.token_to_kv_pool_allocator.available_size() == 992
    assert isinstance(make_runner(path, page_size=1).token_to_kv_pool_allocator, TokenToKVPoolAllocator)
    assert any("KV cache pool: 992 tokens" in r.getMessage() for r in caplog.records)


def test_pool_sizing_from_available_memory(tiny_llama):
    path, _ = tiny_llama
    runner = make_runner(path, max_total_tokens=None, max_running_requests=None)
    # Tiny model, large RAM: the CPU cap applies; request slots follow SGLang's rule, capped on CPU.
    assert runner.max_total_num_tokens == 1 << 18
    assert runner.req_to_token_pool.size == 1024
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, layers, kv heads, head dim, float32
    assert runner.kv_bytes_per_token() == per_token


def test_sample_without_sampling_info_is_argmax(tiny_llama):
    path, _ = tiny_llama
    runner = make_runner(path)
    driver = BatchDriver(runner)
    fb = driver.extend_batch([ExtendReq(driver.new_row(), p) for p in PROMPTS])
    out, tokens = driver.run(fb)
    assert tokens.tolist() == out.next_token_logits.argmax(-1).tolist()
    assert out.next_token_logits.dtype == torch.float32


# ---------------------------------------------------------------------------- config and loading
def _write_config(path, **fields):
    import json

    base = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, num_hidden_layers=2,
                num_attention_heads=4, intermediate_size=128, vocab_size=512, max_position_embeddings=256)
    base.update(fields)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(base))
    return str(path)


def test_sliding_window_is_read_per_layer(tmp_path):
    """Sliding-window attention is implemented: the context is the model's own (no longer capped at the
    window) and each layer's window follows the family's rule (layer_types first)."""
    from engine.configs.model_config import ModelConfig

    mistral = _write_config(tmp_path / "mistral", architectures=["MistralForCausalLM"], model_type="mistral",
                            sliding_window=64)
    config = ModelConfig.from_pretrained(mistral, device="cpu")
    assert config.context_len == 256 and config.layer_windows == [64, 64] and config.is_hybrid_swa
    assert ModelConfig.from_pretrained(mistral, context_length=200, device="cpu").context_len == 200
    # Qwen2/Qwen3 carry a window that applies only with use_sliding_window, from max_window_layers on.
    qwen = _write_config(tmp_path / "qwen", architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                         sliding_window=32, use_sliding_window=False)
    assert ModelConfig.from_pretrained(qwen, device="cpu").layer_windows == [-1, -1]
    qwen_swa = _write_config(tmp_path / "qwen_swa", architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                             sliding_window=32, use_sliding_window=True, max_window_layers=1)
    assert ModelConfig.from_pretrained(qwen_swa, device="cpu").layer_windows == [-1, 32]
    typed = _write_config(tmp_path / "typed", architectures=["MistralForCausalLM"], model_type="mistral",
                          sliding_window=16, layer_types=["full_attention", "sliding_attention"])
    assert ModelConfig.from_pretrained(typed, device="cpu").layer_windows == [-1, 16]
    bad = _write_config(tmp_path / "bad", architectures=["MistralForCausalLM"], model_type="mistral",
                        sliding_window=16, layer_types=["sliding_attention"])
    with pytest.raises(ValueError, match="layer_types lists 1 layers"):
        ModelConfig.from_pretrained(bad, device="cpu")


def test_unknown_architecture_lists_supported_ones(tmp_path):
    from engine.configs.model_config import ModelConfig

    path = _write_config(tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError) as err:
        ModelConfig.from_pretrained(path)
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GPT2LMHeadModel"):
        assert name in str(err.value)


def test_config_fields_dtype_and_eos(tmp_path):
    import json

    from engine.configs.model_config import ModelConfig

    path = _write_config(tmp_path, torch_dtype="bfloat16", eos_token_id=[2, 7], tie_word_embeddings=True,
                         rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=5e5)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    c = ModelConfig.from_pretrained(path, context_length=100, device="cpu")
    assert c.dtype == torch.bfloat16  # auto follows the checkpoint
    assert c.eos_token_ids == {2, 7, 9}
    assert c.head_dim == 16 and c.num_key_value_heads == 4  # defaults: hidden/heads, MHA
    assert c.context_len == 100 and c.tie_word_embeddings
    assert c.rope_theta == 5e5 and c.rope_scaling["rope_type"] == "linear"
    assert ModelConfig.from_pretrained(path, dtype="float32").dtype == torch.float32
    assert ModelConfig.from_pretrained(path, dtype="float16", device="cpu").dtype == torch.bfloat16
    assert ModelConfig.from_pretrained(path, dtype="float16", device="cuda").dtype == torch.float16
    assert ModelConfig.from_pretrained(path).context_len == 256
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig.from_pretrained(path, dtype="int8")


def test_missing_and_duplicate_weights_raise(tiny_llama):
    from engine.model_loader.weight_utils import safetensors_weights_iterator

    path, _ = tiny_llama
    runner = make_runner(path)
    weights = list(safetensors_weights_iterator(path))
    missing = [(n, t) for n, t in weights if "layers.1.self_attn.k_proj" not in n]
    with pytest.raises(ValueError, match=r"missing.*qkv_proj.weight\[k\]"):
        runner.model.load_weights(missing)
    with pytest.raises(ValueError, match="loaded twice"):
        runner.model.load_weights(weights + weights[:1])
    runner.model.load_weights(weights)  # and the complete checkpoint loads cleanly


def test_auto_dtype_is_bfloat16_on_cuda_for_a_float32_checkpoint():
    import torch

    from engine.configs.model_config import resolve_dtype

    assert resolve_dtype("auto", {"torch_dtype": "float32"}, "cuda") == torch.bfloat16
    assert resolve_dtype("auto", {"torch_dtype": "float32"}, "cpu") == torch.float32
    assert resolve_dtype("float32", {"torch_dtype": "float32"}, "cuda") == torch.float32
    assert resolve_dtype("auto", {"torch_dtype": "float16"}, "cpu") == torch.bfloat16


@pytest.mark.slow  # a fresh Python process that imports the engine and torch
def test_a_broken_allocator_import_fails_loudly(tiny_llama):
    """A runner without its KV slot allocator cannot serve: an ImportError must surface, not turn
    into a None allocator that fails later and far away."""
    import subprocess
    import textwrap

    code = textwrap.dedent(f"""
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "engine.mem_cache.allocator":
                    raise ImportError("blocked by the test: " + name)
                return None

        sys.meta_path.insert(0, Block())
        from utils_models import make_runner
        runner = make_runner({tiny_llama[0]!r})
        print("allocator:", runner.token_to_kv_pool_allocator)
    """)
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # utils_models
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode != 0, result.stdout
    assert "ImportError: blocked by the test: engine.mem_cache.allocator" in result.stderr, result.stderr[-2000:]
