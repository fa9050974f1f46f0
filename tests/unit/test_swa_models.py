"""Sliding-window and hybrid (local + global) attention models against transformers, far past the window:
Mistral (every layer windowed), Qwen2 with use_sliding_window (layers from max_window_layers on), Gemma 2 (alternating local/global layers, pre+post norms, (1 + w)
RMSNorm, attention and final logit soft-caps, query_pre_attn_scalar, scaled embedding, tanh gelu) and
Gemma 3 text (layer_types, q/k norms, a local rotary base). Small random float32 checkpoints with a
window of 16 and prompts of 100-260 tokens: logits at every prompt position, and greedy tokens through
the real scheduler under radix cache on/off, paging, chunked prefill and mixed chunks."""

from __future__ import annotations

from typing import List

import pytest
import torch

from sched_utils import Harness
from utils_models import BatchDriver, ExtendReq, LetterTokenizer, TINY_SWA, build_tiny_model, hf_greedy, hf_logits, make_runner

from engine.server_args import ServerArgs

ARCHS = ["mistral", "qwen2", "gemma2", "gemma3", "gpt_oss"]
N_NEW = 24  # decode steps: every one of them past the window


def _prompts() -> List[List[int]]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (100, 173, 260)]
    prompts.append(prompts[2][:200] + [7, 8, 9, 10, 11])  # shares a cached prefix with the third
    return prompts


@pytest.fixture(autouse=True)
def kernel_path_only(monkeypatch):
    """Every windowed, soft-capped or sink layer here (float32 or bf16 on the CPU) runs on the native
    kernel's masked rows (layers/attention/kernel_rows.py): the torch path they replace fails if taken."""
    from engine.layers.attention import torch_native_backend

    def taken(*args, **kwargs):
        raise AssertionError("the windowed torch path was taken where the kernel takes the call")

    monkeypatch.setattr(torch_native_backend, "windowed_decode", taken)
    monkeypatch.setattr(torch_native_backend, "windowed_extend", taken)


@pytest.fixture(scope="module", params=ARCHS)
def swa_model(request, tmp_path_factory):
    arch = request.param
    path = str(tmp_path_factory.mktemp(arch))
    # Gemma checkpoints tie the head to the embedding; Mistral's and Qwen2's here do not.
    hf = build_tiny_model(path, arch, seed=11, tie_word_embeddings=arch.startswith("gemma"), **TINY_SWA[arch])
    expected = [hf_greedy(hf, p, N_NEW) for p in _prompts()]
    return arch, path, hf, expected


def test_windows_are_read_per_layer(swa_model):
    arch, path, _, _ = swa_model
    runner = make_runner(path)
    windows = [layer.self_attn.attn.sliding_window_size for layer in runner.model.model.decoder_layers]
    assert windows == {"mistral": [16, 16], "qwen2": [-1, 16], "gemma2": [16, -1, 16], "gemma3": [16, -1, 16],
                       "gpt_oss": [16, -1]}[arch]
    assert runner.model_config.context_len == 1024  # no longer capped at the window


def test_logits_match_transformers_past_the_window(swa_model):
    arch, path, hf, _ = swa_model
    runner = make_runner(path)
    driver = BatchDriver(runner)
    prompts = _prompts()[:3]
    fb = driver.extend_batch([ExtendReq(driver.new_row(), p) for p in prompts])
    model = runner.model
    with torch.inference_mode():
        runner.attn_backend.init_forward_metadata(fb)
        hidden = model.model(fb.input_ids, fb.positions, fb)
        logits = model.logits_processor.compute_logits(hidden, model.lm_head)
    offset = 0
    for prompt in prompts:
        ref = hf_logits(hf, prompt)
        assert (logits[offset:offset + len(prompt)] - ref).abs().max().item() < 2e-4, arch
        offset += len(prompt)


CONFIGS = {
    "default": {},
    "no-radix": dict(disable_radix_cache=True),
    "page16-chunk32": dict(page_size=16, chunked_prefill_size=32),
    "mixed-chunk24": dict(chunked_prefill_size=24, enable_mixed_chunk=True),
    "overlap-chunk32": dict(overlap=True, chunked_prefill_size=32),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.slow  # in the full suite; the fast lane keeps the cheaper cases
def test_scheduler_greedy_equals_transformers(swa_model, config):
    from engine.scheduler.tp_worker import TpModelWorker

    arch, path, _, expected = swa_model
    kwargs = dict(CONFIGS[config])
    page = kwargs.get("page_size", 1)
    # The pool is sized from the chunk as in a server (one set of arguments): the hybrid pool at page 16.
    chunk = {"chunked_prefill_size": kwargs["chunked_prefill_size"]} if page > 1 else {}
    worker = TpModelWorker(ServerArgs(model_path=path, device="cpu", max_total_tokens=4096, page_size=page,
                                      max_running_requests=16, **chunk))
    if page > 1:  # the paged hybrid pool (its windowed pages released a page at a time)
        from engine.mem_cache.swa_pool import SWATokenToKVPoolAllocator

        assert isinstance(worker.model_runner.token_to_kv_pool_allocator, SWATokenToKVPoolAllocator)
    h = Harness(worker=worker, tokenizer=LetterTokenizer(), max_total_tokens=4096, **kwargs)
    prompts = _prompts()
    rids = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True) for p in prompts[:3]]
    h.run_until_idle()
    # Then the prompt that shares 200 tokens with the third: with the radix cache, its prefix is reused.
    rids.append(h.submit(prompts[3], max_new_tokens=N_NEW, ignore_eos=True))
    h.run_until_idle()
    assert [h.outputs[r].output_ids for r in rids] == expected, (arch, config)


def test_bfloat16_decode_stays_close_to_float32(swa_model):
    """bf16 on the CPU: the windowed layers leave the native decode chain for the kernel's masked rows;
    prefill and a decode step past the window stay as close to float32 as
    transformers' own bf16 run does (within 2x of its error: Gemma's scaled embeddings and four norms a
    layer put that at a few percent of the largest logit on these random weights)."""
    import copy

    arch, path, hf, _ = swa_model
    prompt = _prompts()[0]
    logits = {}
    for dtype in ("float32", "bfloat16"):
        runner = make_runner(path, dtype=dtype)
        driver = BatchDriver(runner)
        row = driver.new_row()
        out, next_ids = driver.run(driver.extend_batch([ExtendReq(row, prompt)]))
        decode, _ = driver.run(driver.decode_batch([row], [int(next_ids[0])], [len(prompt)]))
        logits[dtype] = torch.cat([out.next_token_logits.float(), decode.next_token_logits.float()])
    with torch.no_grad():
        ids = torch.tensor([prompt + [int(logits["float32"][0].argmax())]])
        hf_error = (copy.deepcopy(hf).to(torch.bfloat16)(ids).logits[0, -2:].float() - hf(ids).logits[0, -2:]).abs().max()
    error = (logits["bfloat16"] - logits["float32"]).abs().max().item()
    assert error < 2 * hf_error.item() + 0.01 * logits["float32"].abs().max().item(), (arch, error, hf_error)


def test_flashinfer_is_refused_for_windowed_layers(swa_model):
    """Our flashinfer wrapper computes plain attention only: refused at start-up, not silently full."""
    from engine.configs.model_config import ModelConfig
    from engine.model_executor.model_runner import ModelRunner

    _, path, _, _ = swa_model
    args = ServerArgs(model_path=path, device="cpu", max_total_tokens=1024)
    args.attention_backend = "flashinfer"  # ServerArgs allows it with CUDA only; the model check comes first
    with pytest.raises(ValueError, match="no sliding-window"):
        ModelRunner(ModelConfig.from_pretrained(path, device="cpu"), args)


@pytest.mark.parametrize("overlap", [False, True])
def test_retracted_requests_continue_exactly(swa_model, overlap, caplog):
    """A pool too small for the three requests' decodes, admitted optimistically: one is retracted and
    prefilled again past the window, and every output still equals transformers'."""
    from engine.scheduler.tp_worker import TpModelWorker

    arch, path, _, expected = swa_model
    total = 600  # the three prompts take 533 slots, their decodes 72 more
    worker = TpModelWorker(ServerArgs(model_path=path, device="cpu", max_total_tokens=total, max_running_requests=16))
    h = Harness(worker=worker, tokenizer=LetterTokenizer(), max_total_tokens=total, overlap=overlap,
                schedule_conservativeness=0.3)
    with caplog.at_level("WARNING"):
        rids = [h.submit(p, max_new_tokens=N_NEW) for p in _prompts()[:3]]
        h.run_until_idle()
    assert "Retract requests" in caplog.text
    assert [h.outputs[r].output_ids for r in rids] == expected[:3], arch


HYBRID = dict(disable_radix_cache=True, chunked_prefill_size=32, max_prefill_tokens=64, max_running_requests=4)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.slow  # in the full suite; the fast lane keeps the cheaper cases
def test_hybrid_pool_bounds_windowed_kv_and_keeps_outputs(swa_model, overlap, page):
    """Without the radix cache the windowed layers get their own pool (mem_cache/swa_pool.py): tokens that
    left the window are released while the requests run, so that pool never holds more than the
    window bound, while the full pool holds every token; outputs equal transformers' and at idle both
    pools are whole (the strict leak check covers both)."""
    from engine.mem_cache.swa_pool import SWATokenToKVPoolAllocator, swa_pool_size
    from engine.scheduler.tp_worker import TpModelWorker

    arch, path, _, expected = swa_model
    worker = TpModelWorker(ServerArgs(model_path=path, device="cpu", max_total_tokens=4096, page_size=page,
                                      **HYBRID))
    allocator = worker.model_runner.token_to_kv_pool_allocator
    assert isinstance(allocator, SWATokenToKVPoolAllocator)
    bound = swa_pool_size(4096, 16, 4, 32, page_size=page)  # 4 requests, window 16, chunks of 32
    assert allocator.swa.size == bound < 4096
    h = Harness(worker=worker, tokenizer=LetterTokenizer(), max_total_tokens=4096, overlap=overlap, page_size=page, **HYBRID)
    prompts = _prompts()
    rids = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True) for p in prompts]
    peak_full = peak_swa = 0
    while h.scheduler.has_work():
        h.step()
        peak_full = max(peak_full, 4096 - allocator.available_size())
        peak_swa = max(peak_swa, allocator.swa.size - allocator.swa_available_size())
    h.step()  # the idle leak check, both pools
    assert [h.outputs[r].output_ids for r in rids] == expected, (arch, overlap)
    # Four requests of 100-260 tokens: the full pool held them whole, the windowed one a fraction.
    assert peak_full >= sum(len(p) for p in prompts[:2])
    assert peak_swa <= bound < peak_full
    assert allocator.swa_available_size() == allocator.swa.size and allocator.available_size() == 4096
    state = h.scheduler.kv.state()
    assert state["swa_max_total_num_tokens"] == bound and state["swa_available_tokens"] == bound


def test_hybrid_pool_only_where_nothing_reads_windowed_kv_by_full_slot(swa_model, caplog):
    """--disable-hybrid-swa-memory keeps the one pool; neither paging (the paged windowed allocator) nor
    the radix cache (the SWA radix cache, test_swa_radix_scheduler.py) does any more."""
    from engine.mem_cache.swa_pool import SWATokenToKVPoolAllocator

    _, path, _, _ = swa_model
    runner = make_runner(path, **dict(HYBRID, disable_hybrid_swa_memory=True))
    assert not isinstance(runner.token_to_kv_pool_allocator, SWATokenToKVPoolAllocator)
    for extra in (dict(page_size=16), dict(disable_radix_cache=False), dict(disable_radix_cache=False, page_size=16)):
        runner = make_runner(path, **dict(HYBRID, **extra))
        allocator = runner.token_to_kv_pool_allocator
        assert isinstance(allocator, SWATokenToKVPoolAllocator), extra
        assert allocator.page_size == allocator.swa.page_size == extra.get("page_size", 1)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.slow  # in the full suite; the fast lane keeps the cheaper cases
def test_hybrid_pool_retraction_continues_exactly(swa_model, overlap, page):
    """Retraction with the hybrid pool (every request, mid-prefill and mid-decode, as the control plane
    retracts): their slots go back to both pools through the one release path, they are prefilled again
    past the window and their outputs still equal transformers'; both pools whole at idle."""
    from engine.mem_cache.swa_pool import SWATokenToKVPoolAllocator
    from engine.scheduler.tp_worker import TpModelWorker

    arch, path, _, expected = swa_model
    worker = TpModelWorker(ServerArgs(model_path=path, device="cpu", max_total_tokens=4096, page_size=page,
                                      **HYBRID))
    allocator = worker.model_runner.token_to_kv_pool_allocator
    assert isinstance(allocator, SWATokenToKVPoolAllocator)
    h = Harness(worker=worker, tokenizer=LetterTokenizer(), max_total_tokens=4096, overlap=overlap, page_size=page, **HYBRID)
    rids = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True) for p in _prompts()]
    for _ in range(20):  # some requests decoding past the window, one mid-prefill
        h.step()
    h.scheduler.settle()
    h.scheduler.retract_all()
    assert allocator.swa_available_size() == allocator.swa.size and allocator.available_size() == 4096
    h.run_until_idle()
    assert [h.outputs[r].output_ids for r in rids] == expected, (arch, overlap)


@pytest.fixture(scope="module", params=["mistral", "gemma3"])
def window64_model(request, tmp_path_factory):
    """A window of 64 (four pages of 16) and prompts of 300+ tokens, the second sharing 260 with the first."""
    arch = request.param
    path = str(tmp_path_factory.mktemp(f"{arch}_w64"))
    hf = build_tiny_model(path, arch, seed=17, tie_word_embeddings=arch.startswith("gemma"),
                          **dict(TINY_SWA[arch], sliding_window=64))
    gen = torch.Generator().manual_seed(8)
    first = torch.randint(0, 512, (310,), generator=gen).tolist()
    prompts = [first, first[:260] + torch.randint(0, 512, (75,), generator=gen).tolist()]
    return arch, path, prompts, [hf_greedy(hf, p, N_NEW) for p in prompts]


@pytest.mark.parametrize("radix,overlap", [(True, True), (False, False)])
@pytest.mark.slow
def test_paged_hybrid_pool_window_64_equals_transformers(window64_model, radix, overlap):
    """Page 16, window 64: the windowed pool's pages leave as the decode passes them (its peak stays at
    its bound, far below the full pool's); with the radix cache the second prompt reuses 256 tokens (whole
    pages) whose last window is still held; outputs equal transformers'; both pools whole at idle."""
    from engine.mem_cache.swa_pool import SWATokenToKVPoolAllocator
    from engine.scheduler.tp_worker import TpModelWorker

    arch, path, prompts, expected = window64_model
    args = dict(page_size=16, chunked_prefill_size=64, max_prefill_tokens=128, max_running_requests=4,
                disable_radix_cache=not radix)
    worker = TpModelWorker(ServerArgs(model_path=path, device="cpu", max_total_tokens=4096, **args))
    allocator = worker.model_runner.token_to_kv_pool_allocator
    assert isinstance(allocator, SWATokenToKVPoolAllocator) and allocator.swa.size < 4096
    h = Harness(worker=worker, tokenizer=LetterTokenizer(), max_total_tokens=4096, overlap=overlap, **args)
    first = h.submit(prompts[0], max_new_tokens=N_NEW, ignore_eos=True)
    h.run_until_idle()
    second = h.submit(prompts[1], max_new_tokens=N_NEW, ignore_eos=True)
    peak_swa = 0
    while h.scheduler.has_work():
        h.step()
        peak_swa = max(peak_swa, allocator.swa.size - allocator.swa_available_size())
    h.step()  # the strict idle leak check, both pools
    assert [h.outputs[first].output_ids, h.outputs[second].output_ids] == expected, (arch, radix)
    assert h.outputs[second].cached_tokens == (256 if radix else 0)
    if not radix:  # one request of 335 + 24 tokens: its window and the pages in flight, not its length
        assert peak_swa <= 64 + 4 * 16 + 2 * 64 < len(prompts[1])


@pytest.mark.parametrize("page", [1, 16])
def test_last_rows_of_windowed_layers_attend_alone(swa_model, page, monkeypatch):
    """An extend's last layer needs each request's last row only (LogitsProcessor.last_rows_suffice):
    a windowed, soft-capped or sink layer (Mistral, Qwen2, Gemma 2 and 3, gpt-oss: the last layer of each is
    windowed)
    attends from those rows alone on the decode kernel, over each last row's window; greedy outputs stay
    transformers'."""
    from engine.layers.attention.kernel_rows import KernelRows
    from engine.scheduler.tp_worker import TpModelWorker

    arch, path, _, expected = swa_model
    calls = []
    attend_last_rows = KernelRows.attend_last_rows

    def counted(self, q_rows, layer):
        calls.append(q_rows.shape[0])
        return attend_last_rows(self, q_rows, layer)

    monkeypatch.setattr(KernelRows, "attend_last_rows", counted)
    chunk = {"chunked_prefill_size": 64} if page > 1 else {}
    worker = TpModelWorker(ServerArgs(model_path=path, device="cpu", max_total_tokens=4096, page_size=page,
                                      max_running_requests=16, **chunk))
    h = Harness(worker=worker, tokenizer=LetterTokenizer(), max_total_tokens=4096, page_size=page, **chunk)
    rids = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True) for p in _prompts()[:3]]
    h.run_until_idle()
    assert [h.outputs[r].output_ids for r in rids] == expected[:3]
    assert calls and all(n <= 3 for n in calls)  # one row per request, never every new token
