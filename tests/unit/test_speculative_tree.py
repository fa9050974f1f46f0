"""Tree drafts (--speculative-eagle-topk > 1, engine/speculative/tree.py): greedy outputs equal
those without speculation token for token for STANDALONE, EAGLE and EAGLE3 under every scheduling
mode; with the draft = the target every step accepts the whole depth; only the accepted path's KV
survives (the strict idle leak check runs after every workload); the tree-masked attention of each
backend equals a dense masked reference; the tree acceptance keeps the target distribution
(chi-square, p < 1e-6)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List, Tuple

import pytest
import torch

from sched_utils import Harness, fast_lane
from test_speculative_ngram import VOCAB, _chi2, _chi2_bound, _prompts, _sampling_info
from utils_models import LetterTokenizer, build_eagle3_head, build_eagle_head, build_tiny_model

from engine.server_args import ServerArgs, ServerArgsError
from engine.speculative.tree import DraftTree, TreeShape, accept_tree, grow_trees, path_moves

N_NEW = 24


@pytest.fixture(autouse=True)
def tree_kernel_only(monkeypatch):
    """Tree-masked forwards here (float32 and bf16 on the CPU) run on the native decode kernel's rows
    (layers/attention/kernel_rows.py): the per-request masked SDPA they replace fails if it is built."""
    from engine.layers.attention.torch_native_backend import TorchNativeAttnBackend

    per_request = TorchNativeAttnBackend._extend_metadata_per_request

    def checked(self, fb):
        assert fb.spec_tree_mask is None, "a tree batch took the per-request SDPA where the kernel takes it"
        return per_request(self, fb)

    monkeypatch.setattr(TorchNativeAttnBackend, "_extend_metadata_per_request", checked)


@pytest.fixture(scope="module")
def tiny():
    from engine.builtin_model import ensure_builtin_model

    return ensure_builtin_model()


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A random 2-layer Llama with the built-in model's vocabulary: a poor draft."""
    path = str(tmp_path_factory.mktemp("tree_draft_small"))
    build_tiny_model(path, seed=3, vocab_size=VOCAB, max_position_embeddings=2048)
    return path


@pytest.fixture(scope="module")
def eagle_pair(tmp_path_factory):
    """A random 2-layer Llama target, a random EAGLE head and a random EAGLE3 head for it."""
    target = str(tmp_path_factory.mktemp("tree_eagle_target"))
    build_tiny_model(target, seed=2, vocab_size=VOCAB, max_position_embeddings=2048, num_hidden_layers=4)
    head = build_eagle_head(str(tmp_path_factory.mktemp("tree_eagle_head")), target, seed=1)
    head3 = build_eagle3_head(str(tmp_path_factory.mktemp("tree_eagle3_head")), target, seed=1)
    return target, head, head3


def _harness(target: str, draft: str = None, algo: str = "STANDALONE", steps: int = 3, topk: int = 2,
             tokens: int = 6, tokenizer=None, **kwargs) -> Harness:
    from engine.scheduler.tp_worker import TpModelWorker

    total = kwargs.pop("max_total_tokens", 4096)
    worker_args = ServerArgs(model_path=target, device="cpu", max_total_tokens=total,
                             page_size=kwargs.get("page_size", 1), max_running_requests=16)
    spec = dict(speculative_algorithm=algo, speculative_draft_model_path=draft, speculative_num_steps=steps,
                speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens,
                speculative_batch_size_threshold=1024, disable_speculative_adaptive=True) if draft is not None else {}
    return Harness(worker=TpModelWorker(worker_args), tokenizer=tokenizer or LetterTokenizer(), max_total_tokens=total, **spec,
                   **kwargs)


def _run(target: str, draft: str, prompts: List[List[int]], sampling: Dict = None, **kwargs
         ) -> Tuple[Harness, List[List[int]], List[str]]:
    h = _harness(target, draft, **kwargs)
    params = dict(max_new_tokens=N_NEW, ignore_eos=True)
    params.update(sampling or {})
    rids = [h.submit(p, **params) for p in prompts]
    h.run_until_idle()  # ends with the strict idle leak check
    return h, [h.outputs[r].output_ids for r in rids], rids


CONFIGS = {
    "default": {},
    "no-radix": dict(disable_radix_cache=True),
    "page16": dict(page_size=16),
    "chunked-mixed": dict(chunked_prefill_size=8),
    "retract": dict(max_total_tokens=192),
}


# Every mode in both loops: with overlap, plain steps are pipelined and a verify step settles first.
MODES = [(name, overlap) for name in CONFIGS for overlap in (False, True)]


@pytest.mark.parametrize("name,overlap", fast_lane(MODES, {("default", False), ("default", True), ("retract", True)}))
def test_standalone_small_draft_keeps_greedy_outputs(tiny, small_draft, name, overlap):
    prompts = _prompts()
    _, plain, _ = _run(tiny, None, prompts, overlap=overlap, **CONFIGS[name])
    h, spec, _ = _run(tiny, small_draft, prompts, overlap=overlap, **CONFIGS[name])
    assert spec == plain
    state = h.scheduler.internal_state()
    assert state["spec_verify_ct"] > 0
    assert state["spec_accepted_tokens"] < state["spec_draft_tokens"]


def _waves(h: Harness, prompts: List[List[int]], sampling: Dict) -> List[List[int]]:
    """The prompts, then each prompt plus the first half of its output (radix-cached prefixes that
    include verified tokens)."""
    rids = [h.submit(p, **sampling) for p in prompts]
    h.run_until_idle()
    first = [h.outputs[r].output_ids for r in rids]
    rids2 = [h.submit(p + o[: len(o) // 2], **sampling) for p, o in zip(prompts, first)]
    h.run_until_idle()
    return first + [h.outputs[r].output_ids for r in rids2]


@pytest.mark.parametrize("name,topk", fast_lane([(n, k) for n in ("default", "page16", "chunked-mixed") for k in (2, 3, 4)],
                                                 {("default", 3), ("page16", 2)}))
def test_draft_equal_to_target_accepts_the_whole_depth(tiny, topk, name):
    """The draft is the target, two steps, the full tree (every candidate verified, so the target's
    greedy path is always in it): every verify step accepts 2 drafts plus the bonus, which holds only
    if the draft's tree mask and positions, the target's, the move of the accepted path's K/V and
    the draft's catch-up over it are right."""
    prompts = _prompts()
    sampling = dict(max_new_tokens=N_NEW, ignore_eos=True)
    plain = _waves(_harness(tiny, **CONFIGS[name]), prompts, sampling)
    h = _harness(tiny, tiny, steps=2, topk=topk, tokens=1 + topk + topk * topk, **CONFIGS[name])
    assert _waves(h, prompts, sampling) == plain
    state = h.scheduler.internal_state()
    assert state["spec_verify_ct"] > 0
    if name != "chunked-mixed":  # no mixed decode steps: 23 tokens = 7 steps of 3, then one cut to 2
        assert state["spec_verify_ct"] == 8 * 2 * len(prompts), state
        assert state["avg_spec_accept_length"] == pytest.approx(23 / 8)
    else:
        assert state["spec_accepted_tokens"] >= 2 * state["spec_verify_ct"] - 2 * 2 * len(prompts), state


@pytest.fixture(scope="module")
def eagle_exact(tmp_path_factory):
    """A target whose next token is argmax(lm_head(embed(t))) (its one layer adds nothing) and the
    identity EAGLE head, which therefore predicts exactly the target's tokens (as in
    test_speculative_eagle.py)."""
    import os

    from safetensors.torch import load_file, save_file

    target = str(tmp_path_factory.mktemp("tree_eagle_exact_target"))
    build_tiny_model(target, seed=2, vocab_size=VOCAB, max_position_embeddings=2048, num_hidden_layers=1)
    file = os.path.join(target, "model.safetensors")
    weights = load_file(file)
    for name in weights:
        if "o_proj" in name or "down_proj" in name:
            weights[name] = torch.zeros_like(weights[name])
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    save_file(weights, file, metadata={"format": "pt"})
    return target, build_eagle_head(str(tmp_path_factory.mktemp("tree_eagle_exact_head")), target, identity=True)


@pytest.mark.parametrize("name,overlap", fast_lane(MODES, {("default", False), ("chunked-mixed", True)}))
def test_eagle_random_head_keeps_greedy_outputs(eagle_pair, name, overlap):
    target, head, _ = eagle_pair
    prompts = _prompts()
    _, plain, _ = _run(target, None, prompts, overlap=overlap, **CONFIGS[name])
    h, spec, _ = _run(target, head, prompts, algo="EAGLE", steps=3, topk=3, tokens=8, overlap=overlap, **CONFIGS[name])
    assert spec == plain
    assert h.scheduler.internal_state()["spec_verify_ct"] > 0


@pytest.mark.parametrize("name", fast_lane(["default", "page16"], {"default"}))
def test_eagle3_random_head_keeps_greedy_outputs(eagle_pair, name):
    target, _, head3 = eagle_pair
    prompts = _prompts()
    _, plain, _ = _run(target, None, prompts, **CONFIGS[name])
    h, spec, _ = _run(target, head3, prompts, algo="EAGLE3", steps=4, topk=2, tokens=10, **CONFIGS[name])
    assert spec == plain
    assert h.scheduler.internal_state()["spec_verify_ct"] > 0


@pytest.mark.parametrize("name", fast_lane(["default", "page16", "chunked-mixed"], {"default"}))
def test_eagle_exact_head_accepts_the_whole_depth(eagle_exact, name):
    """The head predicts the target's tokens and the tree is full (two steps): every verify step
    accepts 2 drafts, so the head's features and K/V follow the accepted path."""
    target, head = eagle_exact
    prompts = _prompts()
    _, plain, _ = _run(target, None, prompts, **CONFIGS[name])
    h, spec, _ = _run(target, head, prompts, algo="EAGLE", steps=2, topk=3, tokens=13, **CONFIGS[name])
    assert spec == plain
    state = h.scheduler.internal_state()
    if name != "chunked-mixed":  # 23 tokens after the prefill's: 7 steps of 3, then one cut to 2
        assert state["spec_verify_ct"] == 8 * len(prompts), state
        assert state["avg_spec_accept_length"] == pytest.approx(23 / 8)


# ---------------------------------------------------------------------------------------- acceptance
def _tree_logits() -> Tuple[DraftTree, torch.Tensor]:
    """Root children: node 1 (token 1), node 2 (token 0); node 3 (token 3) under node 1, node 4
    (token 1) under node 2; one row of target logits per node."""
    tree = DraftTree(tokens=[1, 0, 3, 1], parents=[0, 0, 1, 2])
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.0, 1.5, -0.5, 1.0, 0.2, 0.8],
                           [1.0, 0.0, 1.2, -0.3, 0.4, 0.1], [0.3, 0.3, 0.3, 2.0, 0.0, -2.0],
                           [-1.0, 2.0, 0.0, 0.5, 0.5, 0.5]])
    return tree, logits


def test_greedy_acceptance_follows_the_targets_argmax_through_the_tree():
    tree, logits = _tree_logits()
    info = _sampling_info(1, 6, temperature=0.0)
    # argmax at root is token 0 = node 2; at node 2 token 2, which no child of node 2 holds: bonus 2.
    out = accept_tree(logits, [tree], info)
    assert out.paths == [[2]] and out.outcome.tokens == [[0, 2]] and out.outcome.accepted == [1]
    logits[0, 1] = 5.0  # now node 1 (token 1), then node 3 (token 3: node 1's argmax), then node 3's argmax
    logits[1, 3] = 3.0
    out = accept_tree(torch.cat([logits, logits[:1]]), [tree, None], _sampling_info(2, 6, temperature=0.0))
    assert out.paths[0] == [1, 3] and out.outcome.tokens[0] == [1, 3, 3]
    assert out.paths[1] == [] and len(out.outcome.tokens[1]) == 1  # no tree: its last token's row only
    # The accepted path moves to the rows right after the root: node 3 (row 3) to row 2; node 1 stays.
    assert path_moves([[1, 3], [2]], [0, 10]) == ([3, 12], [2, 11])


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4),
                                    dict(temperature=1.3, top_p=0.8)])
@pytest.mark.slow  # 20000 walks of the tree: ~15 s each on 2 cores
def test_tree_sampling_keeps_the_target_distribution(params):
    """20000 requests with the same tree: the first token is distributed as the root's p, the
    second, after accepting node 1 or node 2, as that node's p (chi-square, p < 1e-6)."""
    from engine.speculative.verify import target_probs

    torch.manual_seed(0)
    tree, base = _tree_logits()
    vocab, n = 6, 20000
    out = accept_tree(base.repeat(n, 1), [tree] * n, _sampling_info(n, vocab, **params))
    probs = target_probs(base, _sampling_info(1, vocab, **params), torch.tensor([0]), torch.zeros(5, dtype=torch.long))
    counts: Dict[Tuple[int, ...], Dict[int, int]] = {(): {}, (1,): {}, (0,): {}}
    for toks in out.outcome.tokens:
        counts[()][toks[0]] = counts[()].get(toks[0], 0) + 1
        if toks[0] in (0, 1):
            assert len(toks) >= 2  # a child accepted: the walk goes on
            counts[(toks[0],)][toks[1]] = counts[(toks[0],)].get(toks[1], 0) + 1
        else:
            assert len(toks) == 1
    for prefix, row in (((), 0), ((1,), 1), ((0,), 2)):
        total = sum(counts[prefix].values())
        expected = {t: total * float(probs[row, t]) for t in range(vocab) if probs[row, t] > 0}
        stat, df = _chi2(counts[prefix], expected)
        assert stat < _chi2_bound(df), (prefix, stat, df, counts[prefix], expected)


def test_tree_growth_selects_by_cumulative_score_and_keeps_parents():
    """A fake draft whose distribution depends only on the depth: the selected nodes are the
    num_draft_tokens - 1 best candidates by cumulative probability, in candidate order, every
    parent before its children; fed nodes come with their parents and depths."""
    vocab = 8
    root_p = torch.tensor([0.6, 0.3, 0.04, 0.03, 0.01, 0.01, 0.005, 0.005])
    child_p = torch.tensor([0.01, 0.01, 0.01, 0.01, 0.01, 0.0, 0.25, 0.7])
    seen: List[Tuple[List[int], List[int], List[int]]] = []

    def root(rows):
        return root_p.log().expand(len(rows), vocab)

    def fed(rows, tokens, parents, depths):
        seen.append((list(tokens[0]), list(parents[0]), list(depths[0])))
        return child_p.log().expand(len(rows), 2, vocab)

    (tree,) = grow_trees(TreeShape(num_steps=3, topk=2, num_draft_tokens=6), [0], root, fed)
    # Step 1 feeds the root's children (tokens 0, 1); step 2 also the best 2 of their 4 children:
    # 7|0 (.42) and 7|1 (.21), not 6|0 (.15).
    assert seen == [([0, 1], [-1, -1], [1, 1]), ([0, 1, 7, 7], [-1, -1, 0, 1], [1, 1, 2, 2])]
    # Best 5 of 10 candidates: 0 (.6), 7|0 (.42), 1 (.3), 7|7|0 (.294), 7|1 (.21); in candidate order
    # (depth 1, then the children of step 1's leaves, then step 2's).
    assert tree.tokens == [0, 1, 7, 7, 7]
    assert tree.parents == [0, 0, 1, 2, 3]
    assert tree.depths() == [0, 1, 1, 2, 2, 3]


# ---------------------------------------------------------------------------------------- attention
def tree_batch(lens: List[int], trees: List[List[int]], page_size: int, dtype: torch.dtype, gen: torch.Generator,
               kv_heads: int = 2, head_dim: int = 64, covered: List[int] = None):
    """A TARGET_VERIFY ForwardBatch: request i has lens[i] cached tokens then a tree of
    len(trees[i]) + 1 nodes (parents given, the root first) on a paged layout; random cached K/V.
    The mask also covers the last covered[i] cached keys, at random (as a draft's tree step covers
    the nodes of its earlier steps). Returns the batch and each request's [nodes, prefix + nodes]
    mask (the dense reference's)."""
    from engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    req_pool = ReqToTokenPool(size=8, max_context_len=256)
    kv = MHATokenToKVPool(size=2048, page_size=page_size, dtype=dtype, head_num=kv_heads, head_dim=head_dim,
                          layer_num=1)
    pages = (torch.randperm(2048 // page_size - 1, generator=gen) + 1).tolist()
    ext = [len(t) + 1 for t in trees]
    slots = []
    for i, (n, e) in enumerate(zip(lens, ext)):
        total = n + e
        mine = torch.tensor([pages.pop() for _ in range(-(-total // page_size))])
        pos = torch.arange(total)
        row = mine[pos // page_size] * page_size + pos % page_size
        req_pool.req_to_token[i + 1, :total] = row.to(torch.int32)
        kv.set_kv_buffer(0, row[:n], torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype),
                         torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype))
        slots.append(row)
    masks, dense = [], []
    covered = covered or [0] * len(lens)
    for n, parents, c in zip(lens, trees, covered):
        tree = DraftTree(tokens=[0] * len(parents), parents=parents).mask()
        block = torch.cat([torch.rand(tree.shape[0], c, generator=gen) < 0.5, tree], dim=1)
        masks.append(block.reshape(-1))
        dense.append(torch.cat([torch.ones(tree.shape[0], n - c, dtype=torch.bool), block], dim=1))
    bs = len(lens)
    seq_lens = [n + e for n, e in zip(lens, ext)]
    fb = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=torch.zeros(sum(ext), dtype=torch.int64),
        positions=torch.zeros(sum(ext), dtype=torch.int64), req_pool_indices=torch.arange(1, bs + 1),
        seq_lens=torch.tensor(seq_lens), seq_lens_cpu=seq_lens,
        out_cache_loc=torch.cat([s[n:] for s, n in zip(slots, lens)]), seq_lens_sum=sum(seq_lens),
        req_to_token_pool=req_pool, token_to_kv_pool=kv)
    fb.extend_num_tokens = sum(ext)
    fb.extend_seq_lens_cpu = ext
    fb.extend_prefix_lens_cpu = list(lens)
    fb.extend_seq_lens = torch.tensor(ext)
    fb.extend_prefix_lens = torch.tensor(lens)
    fb.extend_start_loc = torch.cumsum(fb.extend_seq_lens, 0) - fb.extend_seq_lens
    fb.set_tree_mask(torch.cat(masks), [c + e for c, e in zip(covered, ext)])
    return fb, dense, slots


def dense_tree_reference(q, k, v, fb, dense, slots, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Every request's attention over its whole K/V (the pool's prefix, this forward's nodes) under
    its dense mask, float64."""
    pool = fb.token_to_kv_pool
    k_buf, v_buf = pool.get_kv_buffer(0)
    outs = []
    start = 0
    for mask, row, n in zip(dense, slots, fb.extend_prefix_lens_cpu):
        e = mask.shape[0]
        keys = torch.cat([k_buf[row[:n]].double(), k[start:start + e].double()]).repeat_interleave(heads // kv_heads, 1)
        vals = torch.cat([v_buf[row[:n]].double(), v[start:start + e].double()]).repeat_interleave(heads // kv_heads, 1)
        qs = q[start:start + e].double().view(e, heads, head_dim)
        scores = torch.einsum("ehd,shd->hes", qs, keys) * head_dim ** -0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hes,shd->ehd", scores.softmax(-1), vals).reshape(e, heads * head_dim))
        start += e
    return torch.cat(outs)


# Node parents (0: the root); the last tree's 20 nodes span two 16-row blocks of the Triton kernel.
TREES = [[0, 0, 1, 1, 2], [0, 1, 2], [0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]


@pytest.mark.parametrize("page_size,dtype,covered", [(1, torch.float32, None), (16, torch.bfloat16, [5, 0, 20]),
                                                    (16, torch.float32, [3, 0, 0])])
def test_torch_native_tree_mask_matches_dense_reference(page_size, dtype, covered):
    """The decode kernel's rows under each request's mask (bf16 on the CPU too: the native extend
    kernel is causal only), the per-request masked SDPA refused by tree_kernel_only; requests with and
    without a prefix, one of 40 tokens; with some cached keys under the mask too (a draft's tree step)."""
    from engine.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from engine.layers.radix_attention import RadixAttention

    gen = torch.Generator().manual_seed(page_size)
    heads, kv_heads, head_dim = 8, 2, 64
    fb, dense, slots = tree_batch([17, 0, 40], TREES, page_size, dtype, gen, covered=covered)
    n = fb.out_cache_loc.shape[0]
    q = torch.randn(n, heads * head_dim, generator=gen).to(dtype)
    k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    backend = TorchNativeAttnBackend(SimpleNamespace(device="cpu"))
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    layer = RadixAttention(heads, head_dim, scaling=head_dim ** -0.5, num_kv_heads=kv_heads, layer_id=0)
    out = backend.forward(q, k, v, layer, fb, save_kv_cache=True)
    ref = dense_tree_reference(q, k, v, fb, dense, slots, heads, kv_heads, head_dim)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), err
    # Without the mask the same batch is causal: a different answer, so the mask was applied.
    fb.spec_tree_mask = None
    backend.init_forward_metadata(fb)
    causal = backend.forward(q, k, v, layer, fb, save_kv_cache=True)
    assert ((causal.double() - ref).norm() / ref.norm()).item() > 0.05


def test_tree_flags_bounds_and_refusals(tiny):
    base = dict(device="cpu", speculative_algorithm="EAGLE", speculative_draft_model_path=tiny,
                speculative_num_steps=3, speculative_eagle_topk=2)
    # topk + (num_steps - 1) * topk^2 = 10 candidates: at most 11 verified tokens, kept as given.
    assert ServerArgs(**base, speculative_num_draft_tokens=11).speculative_num_draft_tokens == 11
    assert ServerArgs(**{**base, "speculative_eagle_topk": 4}, speculative_num_draft_tokens=8).speculative_eagle_topk == 4
    for bad, match in ((dict(speculative_num_draft_tokens=12), r"must be in \[2, 11\]"),
                       (dict(speculative_num_draft_tokens=None), "needs --speculative-num-draft-tokens"),
                       (dict(speculative_eagle_topk=17, speculative_num_draft_tokens=8), r"topk must be in \[1, 16\]"),
                       (dict(speculative_eagle_topk=0, speculative_num_draft_tokens=8), r"topk must be in \[1, 16\]"),
                       (dict(speculative_num_steps=40, speculative_eagle_topk=4, speculative_num_draft_tokens=8),
                        "feeds 156 tree nodes"),
                       (dict(speculative_num_draft_tokens=8, attention_backend="flashinfer"), "flashinfer")):
        with pytest.raises(ServerArgsError, match=match):
            ServerArgs(**{**base, **bad})


@pytest.mark.parametrize("max_new", fast_lane([1, 2, 3, 4, 5, 13], {1, 2, 4}))
def test_max_new_tokens_boundary(tiny, max_new):
    prompts = _prompts()
    _, plain, _ = _run(tiny, None, prompts, dict(max_new_tokens=max_new))
    h, spec, rids = _run(tiny, tiny, prompts, dict(max_new_tokens=max_new), topk=3, tokens=10)
    assert spec == plain
    assert all(len(o) == max_new for o in spec)
    assert all(h.outputs[r].finished_reason["type"] == "length" for r in rids)


@pytest.mark.slow  # ~14 s: two stops, two drafts
def test_stop_token_and_stop_string_cut_the_acceptance(tiny, small_draft):
    prompts = _prompts()
    _, base, _ = _run(tiny, None, prompts)
    stop_id = base[3][10]
    stop_str = LetterTokenizer().decode(base[4][7:9])
    for sampling in (dict(stop_token_ids=[stop_id], ignore_eos=False), dict(stop=[stop_str])):
        h0, plain, rids0 = _run(tiny, None, prompts, sampling)
        for draft in (tiny, small_draft):
            h1, spec, rids1 = _run(tiny, draft, prompts, sampling, topk=2, tokens=7)
            assert spec == plain
            assert len(spec[3 if "stop_token_ids" in sampling else 4]) < N_NEW  # the stop really cut it
            assert [h1.outputs[r].finished_reason for r in rids1] == [h0.outputs[r].finished_reason for r in rids0]


def test_abort_mid_request_frees_everything(tiny, small_draft):
    h = _harness(tiny, small_draft, topk=3, tokens=8)
    prompt = _prompts()[3]
    keep = h.submit(prompt, max_new_tokens=N_NEW, ignore_eos=True)
    victim = h.submit(prompt, max_new_tokens=200, ignore_eos=True, stream=True)
    for _ in range(4):
        h.step()
    assert 0 < len(h.outputs[victim].output_ids) < 200
    h.abort(victim)
    h.run_until_idle()  # the strict leak check runs at idle
    assert h.outputs[victim].finished_reason["type"] == "abort"
    _, (plain,), _ = _run(tiny, None, [prompt])
    assert h.outputs[keep].output_ids == plain


@pytest.mark.parametrize("page_size,radix", fast_lane([(1, True), (16, False)], {(16, False)}))
def test_kv_is_conserved_at_every_step(tiny, small_draft, page_size, radix):
    """After every step each running request holds exactly its committed tokens' KV (the tree's
    rejected nodes and the draft's scratch freed, whole pages when paged)."""
    from test_scheduler_invariants import kv_conservation

    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(0, VOCAB, (20,), generator=gen).tolist()
    h = _harness(tiny, small_draft, page_size=page_size, disable_radix_cache=not radix, max_total_tokens=512,
                 steps=4, topk=3, tokens=9)
    for i in range(10):
        body = torch.randint(0, VOCAB, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
        h.submit((shared if i % 2 else []) + body, max_new_tokens=int(torch.randint(1, 40, (1,), generator=gen)),
                 ignore_eos=True)
    steps = 0
    while h.scheduler.has_work():
        h.step()
        kv_conservation(h)
        for req in h.scheduler.running_batch.reqs:
            if not req.finished():
                assert req.kv_allocated_len == len(req.origin_input_ids) + len(req.output_ids) - 1
        steps += 1
        assert steps < 2000
    h.step()  # the strict idle check
    assert h.scheduler.internal_state()["spec_verify_ct"] > 0


@pytest.mark.slow  # ~10 s
def test_greedy_requests_stay_exact_beside_sampled_ones(tiny, small_draft):
    prompts = _prompts()
    _, plain, _ = _run(tiny, None, prompts)
    h = _harness(tiny, small_draft, topk=2, tokens=6)
    greedy = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True) for p in prompts]
    sampled = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True, temperature=1.0, top_p=0.9) for p in prompts]
    h.run_until_idle()
    assert [h.outputs[r].output_ids for r in greedy] == plain
    assert all(len(h.outputs[r].output_ids) == N_NEW for r in sampled)


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tree_tiny_vocab"))
    hf = build_tiny_model(path, seed=5, vocab_size=12)
    return path, hf


@pytest.mark.slow
def test_sampled_outputs_keep_the_target_distribution_end_to_end(tiny_vocab):
    """3000 sampled requests, the draft = the target, a full tree of two steps over a 12-token
    vocabulary (accepted paths land anywhere in the tree, so their K/V are moved): tokens 2 and 3 of
    each output come from verify steps and follow transformers' distribution given the tokens
    before them (chi-square, p < 1e-6)."""
    from engine.scheduler.tp_worker import TpModelWorker

    path, hf = tiny_vocab
    vocab, n, temperature = 12, 3000, 0.9
    prompt = [3, 1, 4, 0, 5, 9, 2, 6, 11, 8, 7, 10]
    worker_args = ServerArgs(model_path=path, device="cpu", max_total_tokens=65536, max_running_requests=256)
    h = Harness(worker=TpModelWorker(worker_args), tokenizer=LetterTokenizer(), max_total_tokens=65536,
                max_running_requests=256, speculative_algorithm="STANDALONE", speculative_draft_model_path=path,
                speculative_num_steps=2, speculative_eagle_topk=3, speculative_num_draft_tokens=13,
                speculative_batch_size_threshold=1024, disable_speculative_adaptive=True)
    rids = [h.submit(prompt, max_new_tokens=3, ignore_eos=True, temperature=temperature) for _ in range(n)]
    h.run_until_idle()
    outs = [tuple(h.outputs[r].output_ids) for r in rids]
    assert all(len(o) == 3 for o in outs)
    state = h.scheduler.internal_state()
    assert state["spec_verify_ct"] > 0 and state["avg_spec_accept_length"] > 1.5, state

    def dist(prefixes: List[Tuple[int, ...]]) -> Dict[Tuple[int, ...], torch.Tensor]:
        with torch.inference_mode():
            ids = torch.tensor([prompt + list(p) for p in prefixes])
            logits = hf(ids).logits[:, -1, :].float()
        return dict(zip(prefixes, torch.softmax(logits / temperature, dim=-1)))

    for depth in (1, 2):
        counts: Dict[Tuple[int, ...], int] = {}
        observed: Dict[Tuple[int, ...], int] = {}
        for o in outs:
            counts[o[:depth]] = counts.get(o[:depth], 0) + 1
            observed[o[:depth + 1]] = observed.get(o[:depth + 1], 0) + 1
        p = dist(sorted(counts))
        total_stat, total_df = 0.0, 0
        for pre, c in counts.items():
            if c < 100:
                continue
            expected = {pre + (t,): c * float(p[pre][t]) for t in range(vocab)}
            stat, df = _chi2({k: v for k, v in observed.items() if k[:depth] == pre}, expected)
            total_stat += stat
            total_df += df
        assert total_df >= 10, (depth, total_df)
        assert total_stat < _chi2_bound(total_df), (depth, total_stat, total_df)


@pytest.mark.parametrize("name", fast_lane(["default", "page16", "chunked-mixed"], {"default"}))
def test_draft_equal_to_target_expands_each_node_by_the_targets_topk(tiny, name, monkeypatch):
    """The draft is the target, four steps: every drafted node's token is among the topk of the
    target's distribution at its parent (the verify forward's row of the parent), at every depth;
    so the draft's tree steps saw what the target sees (prefix, ancestors, positions, the K/V of
    earlier tree steps in their scratch slots)."""
    import engine.speculative.speculator as speculator_module

    topk, checked = 3, [0]
    real = speculator_module.accept_tree

    def checking(logits, trees, info):
        start = 0
        for tree in trees:
            if tree is not None:
                rows = logits[start:start + 1 + len(tree.tokens)].float()
                kth = rows.topk(topk, dim=-1).values[:, -1]
                for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents), start=1):
                    assert rows[parent, token] >= kth[parent] - 1e-3, (node, token, parent)
                    checked[0] += 1
            start += 1 + (len(tree.tokens) if tree is not None else 0)
        return real(logits, trees, info)

    monkeypatch.setattr(speculator_module, "accept_tree", checking)
    prompts = _prompts()
    _, plain, _ = _run(tiny, None, prompts, **CONFIGS[name])
    _, spec, _ = _run(tiny, tiny, prompts, steps=4, topk=topk, tokens=12, **CONFIGS[name])
    assert spec == plain
    assert checked[0] > 100


WINDOWED_ARCHS = ["mistral", "gemma2", "gpt_oss"]  # windows; windows + soft-caps; windows + sinks


@pytest.fixture(scope="module", params=WINDOWED_ARCHS)
def windowed_pair(request, tmp_path_factory):
    """A random windowed target (window 16) and a random draft of the same architecture and vocabulary."""
    from utils_models import TINY_SWA

    arch = request.param
    paths = []
    for seed, name in ((11, "target"), (12, "draft")):
        path = str(tmp_path_factory.mktemp(f"tree_{arch}_{name}"))
        build_tiny_model(path, arch, seed=seed, tie_word_embeddings=arch.startswith("gemma"), **TINY_SWA[arch])
        paths.append(path)
    return arch, paths[0], paths[1]


def _windowed_prompts() -> List[List[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (40, 71, 9)]  # past the window of 16


@pytest.mark.parametrize("name", fast_lane(["default", "no-radix", "page16", "chunked-mixed"], {"default"}))
def test_windowed_softcapped_and_sink_models_keep_greedy_outputs(windowed_pair, name, monkeypatch):
    """Tree drafts on sliding-window (Mistral), soft-capped (Gemma 2) and sink (gpt-oss) layers: the
    verify and draft rows see the keys of their own window on the native kernel (the windowed torch path
    raises here), greedy outputs equal speculation off; the target as its own draft accepts the whole
    depth, which holds only if every node's window is right."""
    from engine.layers.attention import torch_native_backend

    def taken(*args, **kwargs):
        raise AssertionError("the windowed torch path was taken where the kernel takes the call")

    monkeypatch.setattr(torch_native_backend, "windowed_extend", taken)
    _, target, draft = windowed_pair
    prompts = _windowed_prompts()
    _, plain, _ = _run(target, None, prompts, **CONFIGS[name])
    h, spec, _ = _run(target, draft, prompts, steps=3, topk=2, tokens=7, **CONFIGS[name])
    assert spec == plain
    assert h.scheduler.internal_state()["spec_verify_ct"] > 0
    h, spec, _ = _run(target, target, prompts, steps=2, topk=2, tokens=7, **CONFIGS[name])
    assert spec == plain
    state = h.scheduler.internal_state()
    assert state["spec_verify_ct"] > 0
    if name != "chunked-mixed":
        assert state["spec_accepted_tokens"] == 2 * state["spec_verify_ct"], state
    else:  # a mixed step's cut, as in test_draft_equal_to_target_accepts_the_whole_depth
        assert state["spec_accepted_tokens"] >= 2 * state["spec_verify_ct"] - 2 * len(prompts), state


def test_trees_deeper_than_the_window_are_refused_at_start_up(tmp_path):
    """A tree of num_steps drafts must lie inside every window: refused when the speculator is built,
    not at its first tree step."""
    path = str(tmp_path / "mistral")
    build_tiny_model(path, "mistral", sliding_window=3, max_position_embeddings=256)
    with pytest.raises(ValueError, match="deeper than the model's sliding window"):
        _harness(path, path, steps=3, topk=2, tokens=7)
