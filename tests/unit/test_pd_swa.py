"""PD disaggregation of hybrid sliding-window models (issue 39): both servers use the hybrid pool (the
prefill one with the SWA radix cache), the frames carry every position's full-layer K/V and the windowed
layers' K/V where the prefill still holds it, and the decode server keeps windowed slots for the last
window only. Greedy outputs equal transformers' far past the window (window 16, prompts of 100-200
tokens), with a prefix reused on the prefill side, chunked prefill, overlap on both sides, and a decode
server small enough to retract (its KV backed up and restored through the same path)."""

from __future__ import annotations

from typing import List

import pytest
import torch

from pd_utils import PDPair, record_decode_backups
from utils_models import LetterTokenizer, TINY_SWA, build_tiny_model, hf_greedy

N_NEW = 20
SIDE = dict(chunked_prefill_size=32, max_prefill_tokens=64, max_running_requests=4)


def _prompts() -> List[List[int]]:
    gen = torch.Generator().manual_seed(9)
    first = torch.randint(0, 512, (150,), generator=gen).tolist()
    return [first, torch.randint(0, 512, (110,), generator=gen).tolist(),
            first[:120] + torch.randint(0, 512, (40,), generator=gen).tolist()]


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def model(request, tmp_path_factory):
    arch = request.param
    path = str(tmp_path_factory.mktemp(arch))
    hf = build_tiny_model(path, arch, seed=13, tie_word_embeddings=arch.startswith("gemma"), **TINY_SWA[arch])
    return arch, path, [hf_greedy(hf, p, N_NEW) for p in _prompts()]


def _worker(path: str, total: int, mode: str, **extra):
    from engine.scheduler.tp_worker import TpModelWorker
    from engine.server_args import ServerArgs

    return TpModelWorker(ServerArgs(model_path=path, device="cpu", max_total_tokens=total,
                                    disaggregation_mode=mode, **SIDE, **extra))


CONFIGS = {
    "default": dict(),
    "overlap": dict(overlap_prefill=True, overlap_decode=True),
    "decode-retracts": dict(decode_total=288, overlap_decode=True),
    # The prefill keeps its requests' own KV until sent: only their last window on the windowed layers.
    "prefill-chunk-cache": dict(prefill_kwargs=dict(disable_radix_cache=True)),
    # The paged hybrid pool on both sides: frames of whole pages, windowed pages for the last window.
    "page16-overlap": dict(page=16, overlap_prefill=True, overlap_decode=True),
    "page16-prefill-chunk-cache": dict(page=16, prefill_kwargs=dict(disable_radix_cache=True)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pd_of_both_pools_equals_transformers(model, name, monkeypatch):
    from engine.mem_cache.swa_pool import SWATokenToKVPoolAllocator

    backups = record_decode_backups(monkeypatch)

    arch, path, expected = model
    cfg = dict(CONFIGS[name])
    decode_total = cfg.pop("decode_total", 4096)
    page = cfg.pop("page", 1)
    prefill_extra = dict(cfg.pop("prefill_kwargs", {}), page_size=page)
    prefill_worker = _worker(path, 4096, "prefill", **prefill_extra)
    decode_worker = _worker(path, decode_total, "decode", page_size=page)
    for worker in (prefill_worker, decode_worker):
        assert isinstance(worker.model_runner.token_to_kv_pool_allocator, SWATokenToKVPoolAllocator)
    pair = PDPair(prefill_worker=prefill_worker, decode_worker=decode_worker, tokenizer=LetterTokenizer(),
                  prefill_kwargs=dict(max_total_tokens=4096, **SIDE, **prefill_extra),
                  decode_kwargs=dict(max_total_tokens=decode_total, num_reserved_decode_tokens=0, page_size=page, **SIDE),
                  **cfg)
    try:
        prompts = _prompts()
        rids = [pair.submit(p, rid=f"pd{i}", max_new_tokens=N_NEW, ignore_eos=True) for i, p in enumerate(prompts[:2])]
        prefill_allocator = prefill_worker.model_runner.token_to_kv_pool_allocator
        table = prefill_worker.model_runner.req_to_token_pool.req_to_token
        while pair.busy():
            pair.step()
            for sending in pair.prefill.scheduler.disagg.inflight:
                req = sending.req
                # Its own positions (the radix cache's, below cache_protected_len, are evictable there).
                own = table[req.req_pool_idx, req.cache_protected_len:len(req.origin_input_ids)]
                held = int(prefill_allocator.swa_held(own).sum())
                # The window of 16 spans at most two pages of 16 (one slot when unpaged).
                assert held <= (16 if page == 1 else 32), "a request being sent holds windowed K/V beyond its last window"
        # After the first finished: a prompt sharing 120 tokens with it (reused on the prefill side).
        rids.append(pair.submit(prompts[2], rid="pd2", max_new_tokens=N_NEW, ignore_eos=True))
        pair.run_until_idle()
        for rid, want in zip(rids, expected):
            assert pair.decode.outputs[rid].output_ids == want, (arch, name, rid)
        assert pair.prefill.outputs["pd2"].cached_tokens == (0 if prefill_extra.get("disable_radix_cache")
                                                             else 120 - 120 % page)
        assert pair.decode.scheduler.num_extend_tokens_computed == 0
        decode_allocator = decode_worker.model_runner.token_to_kv_pool_allocator
        assert decode_allocator.swa_available_size() == decode_allocator.swa.size  # both pools whole at idle
        if name == "decode-retracts":
            assert backups, "the configuration must make the decode side retract"
    finally:
        pair.close()
