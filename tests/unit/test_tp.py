"""Tensor parallelism in-process: 2 spawned ranks over gloo, a ModelRunner on each.

tp=2 must give the logits of tp=1 (to float tolerance) and transformers' greedy tokens, for Llama,
Qwen2 (1 KV head, replicated on both ranks, QKV bias, odd vocabulary) and Qwen3 (q/k norm, tied
embeddings, odd vocabulary), and the embeddings of tp=1 and transformers for a BERT encoder. Also the DP controller's bookkeeping (LoadBalancer, ReplyGrouper),
the per-iteration message broadcast and the KV pool min-reduction, which need no model.
"""

from __future__ import annotations

import pytest
import torch

from tp_utils import TP, prefill_and_decode, run_tp_ranks, tp_runner
from utils_models import BatchDriver, ExtendReq, build_tiny_bert, build_tiny_model, hf_greedy, hf_hidden_states

DECODE_STEPS = 12
PROMPTS = [[3, 17, 250, 9, 44], [100, 7, 7, 7, 31, 480, 2, 65, 11], [401]]
CONFIGS = {
    # name: (arch, config overrides)
    "llama": ("llama", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen2_kv1_odd_vocab": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=1, vocab_size=509)),
    "qwen3_tied_odd_vocab": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=1, vocab_size=503,
                                           head_dim=16, tie_word_embeddings=True)),
}


def _runner(path: str, tp_size: int):
    return tp_runner(path, tp_size, max_total_tokens=4096)


def _embed(path: str, tp_size: int) -> torch.Tensor:
    """The pooled embeddings of PROMPTS in one batch (an embedding model)."""
    runner = _runner(path, tp_size)
    driver = BatchDriver(runner)
    rows = [driver.new_row() for _ in PROMPTS]
    return runner.forward_embedding(driver.extend_batch([ExtendReq(r, p) for r, p in zip(rows, PROMPTS)])).embeddings


def _run_model(path: str, tp_size: int):
    """Prefill PROMPTS then greedy-decode; returns (prefill logits, per-prompt tokens, the pool's tokens)."""
    runner = _runner(path, tp_size)
    prefill_logits, outputs = prefill_and_decode(runner, PROMPTS, DECODE_STEPS)
    return prefill_logits, outputs, runner.max_total_num_tokens


def _tp2_work(paths: dict):
    """On each rank: every model, then the scheduler process's collective helpers."""
    from engine.distributed import parallel_state as ps
    from engine.model_executor import model_runner

    model_runner.CHECK_TP_SAMPLING = True  # the debug assertion: sampled ids equal on all ranks
    rank = ps.get_tp_rank()
    results = {name: (_embed if name == EMBEDDING_MODEL else _run_model)(path, TP) for name, path in paths.items()}
    msgs = ps.broadcast_bytes_list([b"abc", b"", b"\x00\xff" * 10] if rank == 0 else None)
    empty = ps.broadcast_bytes_list([] if rank == 0 else None)
    pool_min = ps.all_reduce_min_int(1000 + rank)
    states = ps.gather_objects_to_rank0({"rank": rank})
    return results, msgs, empty, pool_min, states, ps.comm_stats.calls


# A BERT encoder (mean pooling): 4 heads and the MLP split over the ranks.
EMBEDDING_MODEL = "bert"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    paths, expected = {}, {}
    for name, (arch, overrides) in CONFIGS.items():
        path = str(tmp_path_factory.mktemp(name))
        hf = build_tiny_model(path, arch, **overrides)
        paths[name] = path
        expected[name] = [hf_greedy(hf, p, DECODE_STEPS + 1) for p in PROMPTS]
    path = str(tmp_path_factory.mktemp(EMBEDDING_MODEL))
    hf = build_tiny_bert(path, pooling_mode="mean")
    paths[EMBEDDING_MODEL] = path
    expected[EMBEDDING_MODEL] = torch.stack(
        [torch.nn.functional.normalize(hf_hidden_states(hf, p).mean(0), dim=-1) for p in PROMPTS])
    return paths, expected


@pytest.fixture(scope="module")
def tp2_results(models):
    return run_tp_ranks(_tp2_work, models[0], check_exit=True)


# The tests on tp2_results share two spawned ranks that build every model (about a minute).
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp2_matches_tp1_and_transformers(models, tp2_results, name):
    paths, expected = models
    logits1, tokens1, _ = _run_model(paths[name], 1)
    logits2, tokens2, pool2 = tp2_results[0][name]
    vocab = CONFIGS[name][1].get("vocab_size", 512)
    assert logits2.shape == (len(PROMPTS), vocab)  # padding rows of the sharded head are sliced off
    torch.testing.assert_close(logits2, logits1, rtol=1e-4, atol=1e-4)
    assert tokens1 == expected[name]
    assert tokens2 == expected[name]
    assert pool2 == 4096


@pytest.mark.slow
def test_tp2_encoder_embeddings_match_tp1_and_transformers(models, tp2_results):
    paths, expected = models
    tp1 = _embed(paths[EMBEDDING_MODEL], 1)
    tp2 = tp2_results[0][EMBEDDING_MODEL]
    torch.testing.assert_close(tp2, tp1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tp2, expected[EMBEDDING_MODEL], rtol=2e-5, atol=2e-5)


@pytest.mark.slow
def test_tp_collective_helpers(tp2_results):
    _, msgs, empty, pool_min, states, comm_calls = tp2_results
    assert msgs == [b"abc", b"", b"\x00\xff" * 10]
    assert empty == []
    assert pool_min == 1000  # the smallest pool of all ranks wins
    assert states == [{"rank": 0}, {"rank": 1}]
    assert comm_calls > 0  # the model's all-reduces / all-gathers went through the counted path


def test_qkv_kv_head_replication_layout():
    """With 1 KV head and tp 2 both ranks hold the same K/V rows and different Q rows."""
    from engine.distributed import parallel_state as ps
    from engine.layers.linear import QKVParallelLinear

    hidden, head_dim, heads = 8, 4, 4
    full_q = torch.randn(heads * head_dim, hidden)
    full_k = torch.randn(head_dim, hidden)
    full_v = torch.randn(head_dim, hidden)
    shards = []
    try:
        for rank in range(2):
            ps.init_tp_group(rank, 2, None, None)
            layer = QKVParallelLinear(hidden, head_dim, heads, 1, bias=False)
            for sid, w in (("q", full_q), ("k", full_k), ("v", full_v)):
                layer.weight_loader(layer.weight, w, sid)
            shards.append(layer.weight.detach().clone())
    finally:
        ps.init_tp_group(0, 1, None, None)
    q_rows = 2 * head_dim
    assert torch.equal(shards[0][:q_rows], full_q[:q_rows])
    assert torch.equal(shards[1][:q_rows], full_q[q_rows:])
    for shard in shards:
        assert torch.equal(shard[q_rows:q_rows + head_dim], full_k)
        assert torch.equal(shard[q_rows + head_dim:], full_v)


# ---------------------------------------------------------------------- data parallel bookkeeping
def test_round_robin_balancer_alternates():
    from engine.dp_controller.controller import LoadBalancer

    lb = LoadBalancer(3, "round_robin")
    assert [lb.choose() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_shortest_queue_counts_dispatches_since_the_poll():
    from engine.dp_controller.controller import LoadBalancer

    lb = LoadBalancer(2, "shortest_queue")
    assert [lb.choose() for _ in range(4)] == [0, 1, 0, 1]  # ties spread evenly
    lb.on_poll_sent(0)
    lb.on_poll_sent(1)
    lb.choose()  # -> 0, dispatched after the poll: not in the report
    lb.on_poll_reply(0, {"num_running_reqs": 0, "num_waiting_reqs": 0})  # replica 0 finished its two
    lb.on_poll_reply(1, {"num_running_reqs": 2, "num_waiting_reqs": 1})
    assert lb.load(0) == 1 and lb.load(1) == 3
    assert [lb.choose() for _ in range(2)] == [0, 0]
    assert lb.load(0) == 3 and lb.choose() == 1  # tie at 3: round robin continues at 1


def test_reply_grouper_pairs_replies_per_call_and_keeps_polls():
    from engine.dp_controller.controller import _POLL, _TOKENIZER, ReplyGrouper

    g = ReplyGrouper(2)
    for d in (0, 1):
        g.on_request(d, _TOKENIZER)  # call A
    g.on_request(0, _POLL)
    for d in (0, 1):
        g.on_request(d, _TOKENIZER)  # call B
    assert g.on_reply(0, "A0") == _TOKENIZER
    assert g.on_reply(0, "poll0") == _POLL
    assert g.on_reply(0, "B0") == _TOKENIZER
    assert g.pop_complete() == []  # replica 1 has not answered yet
    g.on_reply(1, "A1")
    assert g.pop_complete() == [["A0", "A1"]]
    g.on_reply(1, "B1")
    assert g.pop_complete() == [["B0", "B1"]]
