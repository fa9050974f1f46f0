"""PD disaggregation of multi-head latent attention models (DeepSeek-V2 / V3): the frames carry each
token's one latent row per layer (the MLA pool's single plane, MHATokenToKVPool.layer_planes), not K and
V planes. Greedy outputs of the pair equal transformers', with a prefix reused on the prefill side,
chunked prefill, paging, overlap on both sides and a decode server small enough to retract (its latent KV
backed up and restored through the same path); an MLA server and an MHA one refuse to pair."""

from __future__ import annotations

from typing import List

import pytest
import torch

from pd_utils import PDPair, record_decode_backups
from utils_models import LetterTokenizer, build_tiny_model, hf_greedy

N_NEW = 12
SIDE = dict(chunked_prefill_size=16, max_prefill_tokens=32, max_running_requests=4)


def _prompts() -> List[List[int]]:
    gen = torch.Generator().manual_seed(5)
    first = torch.randint(0, 512, (40,), generator=gen).tolist()
    return [first, torch.randint(0, 512, (27,), generator=gen).tolist(),
            first[:32] + torch.randint(0, 512, (9,), generator=gen).tolist()]


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def model(request, tmp_path_factory):
    arch = request.param
    path = str(tmp_path_factory.mktemp(arch))
    hf = build_tiny_model(path, arch, seed=17)
    return arch, path, [hf_greedy(hf, p, N_NEW) for p in _prompts()]


def _worker(path: str, total: int, mode: str, **extra):
    from engine.scheduler.tp_worker import TpModelWorker
    from engine.server_args import ServerArgs

    return TpModelWorker(ServerArgs(model_path=path, device="cpu", max_total_tokens=total,
                                    disaggregation_mode=mode, **SIDE, **extra))


CONFIGS = {
    "default": dict(),
    "overlap-page16": dict(page=16, overlap_prefill=True, overlap_decode=True),
    "decode-retracts": dict(decode_total=80, overlap_decode=True),
}


# The fast lane keeps the default configuration; the others run in the full suite.
@pytest.mark.parametrize("name", [n if n == "default" else pytest.param(n, marks=pytest.mark.slow) for n in CONFIGS])
def test_pd_of_the_latent_pool_equals_transformers(model, name, monkeypatch):
    from engine.mem_cache.mla_pool import MLATokenToKVPool

    backups = record_decode_backups(monkeypatch)
    arch, path, expected = model
    cfg = dict(CONFIGS[name])
    decode_total = cfg.pop("decode_total", 4096)
    page = cfg.pop("page", 1)
    prefill_worker = _worker(path, 4096, "prefill", page_size=page)
    decode_worker = _worker(path, decode_total, "decode", page_size=page)
    for worker in (prefill_worker, decode_worker):
        assert isinstance(worker.model_runner.token_to_kv_pool, MLATokenToKVPool)
    pair = PDPair(prefill_worker=prefill_worker, decode_worker=decode_worker, tokenizer=LetterTokenizer(),
                  prefill_kwargs=dict(max_total_tokens=4096, page_size=page, **SIDE),
                  decode_kwargs=dict(max_total_tokens=decode_total, num_reserved_decode_tokens=0, page_size=page,
                                     **SIDE),
                  **cfg)
    try:
        prompts = _prompts()
        rids = [pair.submit(p, rid=f"pd{i}", max_new_tokens=N_NEW, ignore_eos=True) for i, p in enumerate(prompts[:2])]
        pair.run_until_idle()
        # After the first finished: a prompt sharing 32 tokens with it (reused on the prefill side).
        rids.append(pair.submit(prompts[2], rid="pd2", max_new_tokens=N_NEW, ignore_eos=True))
        pair.run_until_idle()
        for rid, want in zip(rids, expected):
            assert pair.decode.outputs[rid].output_ids == want, (arch, name, rid)
        assert pair.prefill.outputs["pd2"].cached_tokens == 32 - 32 % page
        assert pair.decode.scheduler.num_extend_tokens_computed == 0
        if name == "decode-retracts":
            assert backups, "the configuration must make the decode side retract"
    finally:
        pair.close()


def test_latent_frames_have_one_plane_and_do_not_pair_with_mha(model):
    from engine.disaggregation.kv_io import KVLayout, gather_kv, pair_ranks, scatter_kv

    _, path, _ = model
    pool = _worker(path, 256, "null").model_runner.token_to_kv_pool
    assert pool is not None
    for layer in range(pool.layer_num):
        pool.k_buffer[layer].copy_(torch.randn_like(pool.k_buffer[layer]))
    slots = torch.tensor([3, 9, 4])
    frame = gather_kv(pool, slots)
    assert frame.shape == (pool.layer_num, 1, 3, 1, pool.head_dim)
    dest = torch.tensor([20, 21, 22])
    scatter_kv(pool, dest, frame)
    for layer in range(pool.layer_num):
        assert torch.equal(pool.k_buffer[layer][dest], pool.k_buffer[layer][slots])
    # The latent is replicated over TP ranks: every decode rank pulls it whole from prefill rank 0.
    latent = KVLayout.of_pool(pool, 1, 2, 1)
    assert latent.planes == 1 and latent.bytes_per_token() == pool.layer_num * pool.head_dim * 4
    assert pair_ranks(KVLayout.of_pool(pool, 1, 1, 0), latent) == (0, 0, 1)
    assert KVLayout.from_dict(latent.to_dict()) == latent
    mha = KVLayout(num_layers=latent.num_layers, total_kv_heads=1, head_dim=latent.head_dim, dtype=latent.dtype,
                   tp_size=1, tp_rank=0)
    with pytest.raises(ValueError, match="planes"):
        pair_ranks(mha, latent)
