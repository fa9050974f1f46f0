"""Speculative decoding on DeepSeek-V2/V3 (MLA) targets: the verify forward and a DeepSeek-shaped draft
attend over the latent KV pool (mem_cache/mla_pool.py, layers/attention/mla_torch.py), tree masks
included. Greedy outputs equal those without speculation token for token (NGRAM, STANDALONE with a small
DeepSeek draft, a perturbed copy of the target or the target itself), chains and trees, radix cache on and
off, overlap on and off; with the target as its own draft every draft is accepted (the draft's latent
K/V follow the target's exactly, the accepted path's moves included); the strict idle leak check runs
after every workload, so rejected drafts' latent K/V are freed."""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch

from sched_utils import Harness, fast_lane
from test_speculative_draft import _waves as draft_waves
from utils_models import LetterTokenizer, build_tiny_model

from engine.server_args import ServerArgs

N_NEW = 16
VOCAB = 512  # utils_models.TINY's


def _prompts() -> List[List[int]]:
    gen = torch.Generator().manual_seed(21)
    rand = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 23, 40)]
    # Text that repeats: the n-gram drafter finds its suffix earlier in the prompt.
    return rand + [rand[1] * 3]


def perturbed_copy(src: str, dst: str, scale: float, seed: int) -> str:
    """The checkpoint in `src` with every weight moved by `scale` of its own spread: a draft of the
    target's shape that agrees with it often, not always (accepted paths through a tree's second-best
    nodes as well as its best)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = load_file(f"{src}/model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    noisy = {name: (w + scale * w.float().std().nan_to_num(0.0) * torch.randn(w.shape, generator=gen)).to(w.dtype)
             if w.is_floating_point() and w.numel() > 1 else w for name, w in weights.items()}
    save_file(noisy, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Dict[str, str]:
    """A DeepSeek-V3-shaped target (q latent, sigmoid grouped routing), a one-layer DeepSeek-V2-shaped
    random draft (a poor one) and a perturbed copy of the target (a good one)."""
    target = str(tmp_path_factory.mktemp("mla_target"))
    build_tiny_model(target, "deepseek_v3", seed=11)
    small = str(tmp_path_factory.mktemp("mla_small_draft"))
    build_tiny_model(small, "deepseek_v2", seed=5, num_hidden_layers=1)
    close = perturbed_copy(target, str(tmp_path_factory.mktemp("mla_close_draft")), 0.15, seed=2)
    return {"target": target, "small": small, "close": close}


def _spec(algo: str, draft: str = None, steps: int = 3, topk: int = 1, tokens: int = None) -> Dict:
    spec = dict(speculative_algorithm=algo, speculative_batch_size_threshold=1024, disable_speculative_adaptive=True)
    if draft is not None:
        spec.update(speculative_draft_model_path=draft, speculative_num_steps=steps)
    if topk > 1:
        spec.update(speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens)
    return spec


def _harness(target: str, spec: Dict, **kwargs) -> Harness:
    from engine.scheduler.tp_worker import TpModelWorker

    total = kwargs.pop("max_total_tokens", 4096)
    page = kwargs.get("page_size", 1)
    # As one server's arguments: the worker's pool is sized with the draft's.
    worker = TpModelWorker(ServerArgs(model_path=target, device="cpu", max_total_tokens=total, page_size=page,
                                      max_running_requests=16, **spec))
    return Harness(worker=worker, tokenizer=LetterTokenizer(), max_total_tokens=total, **spec, **kwargs)


def _waves(h: Harness) -> List[List[int]]:
    """test_speculative_draft's two waves over this module's prompts (the second from the radix cache)."""
    return draft_waves(h, _prompts(), dict(max_new_tokens=N_NEW, ignore_eos=True))


_plain_cache: Dict[Tuple[str, str, bool], List[List[int]]] = {}


def _plain(target: str, name: str, overlap: bool) -> List[List[int]]:
    key = (target, name, overlap)
    if key not in _plain_cache:
        _plain_cache[key] = _waves(_harness(target, {}, overlap=overlap, **CONFIGS[name]))
    return _plain_cache[key]


CONFIGS = {
    "default": {},
    "no-radix": dict(disable_radix_cache=True),
    "page16": dict(page_size=16),
    "chunked-mixed": dict(chunked_prefill_size=8),
}
MODES = [(name, overlap) for name in CONFIGS for overlap in (False, True)]


@pytest.mark.parametrize("name,overlap", fast_lane(MODES, {("default", False), ("no-radix", True)}))
def test_ngram_keeps_greedy_outputs(models, name, overlap):
    h = _harness(models["target"], _spec("NGRAM"), overlap=overlap, **CONFIGS[name])
    assert _waves(h) == _plain(models["target"], name, overlap)
    assert h.scheduler.internal_state()["spec_verify_ct"] > 0


DRAFTS = [("small", 1), ("close", 1), ("close", 2), ("small", 3)]  # (draft, topk): chains and trees


@pytest.mark.parametrize("draft,topk", DRAFTS)
@pytest.mark.parametrize("name,overlap", fast_lane(MODES, {("default", False), ("no-radix", True)}))
def test_deepseek_draft_keeps_greedy_outputs(models, draft, topk, name, overlap):
    spec = _spec("STANDALONE", models[draft], steps=3, topk=topk, tokens=1 + topk + 2 * topk * topk)
    h = _harness(models["target"], spec, overlap=overlap, **CONFIGS[name])
    assert _waves(h) == _plain(models["target"], name, overlap)
    state = h.scheduler.internal_state()
    assert state["spec_verify_ct"] > 0
    assert state["spec_accepted_tokens"] < state["spec_draft_tokens"]  # rejections happen: their K/V freed
    if draft == "close":  # a draft close to the target: drafts are accepted too
        assert state["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("topk", [1, 2])
@pytest.mark.parametrize("name,overlap", fast_lane(MODES, {("default", False), ("page16", True)}))
def test_target_as_its_own_draft_accepts_the_whole_depth(models, topk, name, overlap):
    """The draft is the target: its latent K/V are the target's at every position only if the draft
    follows the verified tokens (catch-up, accepted drafts, the tree's moved path), so every verify
    step accepts every draft (a chain's 3, the full tree's depth 2)."""
    steps = 3 if topk == 1 else 2
    spec = _spec("STANDALONE", models["target"], steps=steps, topk=topk, tokens=1 + topk + topk * topk)
    h = _harness(models["target"], spec, overlap=overlap, **CONFIGS[name])
    assert _waves(h) == _plain(models["target"], name, overlap)
    state = h.scheduler.internal_state()
    if topk == 1:
        assert state["spec_accepted_tokens"] == state["spec_draft_tokens"] > 0, state
    if name != "chunked-mixed":  # no mixed decode steps: 15 tokens after the prefill's, steps + 1 a step
        per_request = -(-(N_NEW - 1) // (steps + 1))  # the last step's drafts cut to the budget
        assert state["spec_verify_ct"] == per_request * 2 * len(_prompts()), state
        assert state["avg_spec_accept_length"] == pytest.approx((N_NEW - 1) / per_request)


def test_move_kv_of_the_latent_pool_reads_every_source_before_writing():
    """The accepted path of a tree moved into chain order: sources and destinations overlap (slot 2 is
    both), and each destination row ends up with its whole source row, latent and rope key."""
    from engine.mem_cache.mla_pool import MLATokenToKVPool

    pool = MLATokenToKVPool(8, 1, torch.float32, kv_lora_rank=4, qk_rope_head_dim=2, layer_num=2)
    for buf in pool.k_buffer:
        buf.copy_(torch.arange(buf.numel(), dtype=torch.float32).view(buf.shape))
    before = [buf.clone() for buf in pool.k_buffer]
    pool.move_kv(torch.tensor([2, 4]), torch.tensor([1, 2]))
    for buf, old in zip(pool.k_buffer, before):
        assert torch.equal(buf[1], old[2]) and torch.equal(buf[2], old[4])
        assert torch.equal(buf[3:], old[3:]) and torch.equal(buf[0], old[0])
    assert pool.v_buffer[0].data_ptr() == pool.k_buffer[0].data_ptr()  # still a view


def test_draft_memory_is_the_latent_pools(models):
    """The target's pool is sized with the draft's bytes per slot: a DeepSeek-shaped draft stores one
    latent + rope key per layer, and the reported pool bytes count the latent pools' V views once."""
    from engine.configs.model_config import ModelConfig
    from engine.speculative.memory import draft_memory

    args = ServerArgs(model_path=models["target"], device="cpu", max_total_tokens=256,
                      **_spec("STANDALONE", models["small"]))
    target_config = ModelConfig.from_pretrained(models["target"], dtype="float32", device="cpu")
    memory = draft_memory(args, target_config, 1)
    assert memory is not None
    assert memory.kv_bytes_per_token == 1 * (32 + 8) * 4  # one layer, kv_lora_rank 32 + rope 8, float32
    h = _harness(models["target"], _spec("STANDALONE", models["small"]), max_total_tokens=256)
    state = h.scheduler.internal_state()
    slots = 256 + 1  # the pool's padding page
    assert state["kv_pool_bytes"] == slots * 2 * (32 + 8) * 4  # the target's two layers
    assert state["draft_kv_pool_bytes"] == slots * (32 + 8) * 4
