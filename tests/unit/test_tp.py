"""Tensor parallelism in-process: 2 spawned ranks over gloo, a ModelRunner on each.

tp=2 must give the logits of tp=1 (to float tolerance) and transformers' greedy tokens, for Llama,
Qwen2 (1 KV head, replicated on both ranks, QKV bias, odd vocabulary) and Qwen3 (q/k norm, tied
embeddings, odd vocabulary), and the embeddings of tp=1 and transformers for a BERT encoder. Also the DP controller's bookkeeping (LoadBalancer, ReplyGrouper),
the per-iteration message broadcast and the KV pool min-reduction, which need no model.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.multiprocessing as mp

from utils_models import BatchDriver, ExtendReq, build_tiny_bert, build_tiny_model, hf_greedy, hf_hidden_states, make_runner

from engine.utils.network_utils import get_free_port

TP = 2
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
    from engine.configs.model_config import ModelConfig
    from engine.distributed.parallel_state import get_tp_rank
    from engine.model_executor.model_runner import ModelRunner
    from engine.server_args import ServerArgs

    if tp_size == 1:
        return make_runner(path)
    args = ServerArgs(model_path=path, dtype="float32", device="cpu", max_total_tokens=4096,
                      max_running_requests=16, tp_size=tp_size)
    config = ModelConfig.from_pretrained(path, dtype="float32", device="cpu")
    return ModelRunner(config, args, tp_rank=get_tp_rank(), tp_size=tp_size)


def _embed(path: str, tp_size: int) -> torch.Tensor:
    """The pooled embeddings of PROMPTS in one batch (an embedding model)."""
    runner = _runner(path, tp_size)
    driver = BatchDriver(runner)
    rows = [driver.new_row() for _ in PROMPTS]
    return runner.forward_embedding(driver.extend_batch([ExtendReq(r, p) for r, p in zip(rows, PROMPTS)])).embeddings


def _run_model(path: str, tp_size: int):
    """Prefill PROMPTS then greedy-decode; returns (prefill logits, per-prompt tokens)."""
    runner = _runner(path, tp_size)
    driver = BatchDriver(runner)
    rows = [driver.new_row() for _ in PROMPTS]
    out, tokens = driver.run(driver.extend_batch([ExtendReq(r, p) for r, p in zip(rows, PROMPTS)]))
    prefill_logits = out.next_token_logits.clone()
    outputs = [[int(t)] for t in tokens]
    seq_lens = [len(p) for p in PROMPTS]
    for _ in range(DECODE_STEPS):
        _, tokens = driver.run(driver.decode_batch(rows, [o[-1] for o in outputs], seq_lens))
        seq_lens = [n + 1 for n in seq_lens]
        for o, t in zip(outputs, tokens):
            o.append(int(t))
    return prefill_logits, outputs, runner.max_total_num_tokens


def _rank_main(rank: int, port: int, paths: dict, queue) -> None:
    """One TP rank: join the group, run every model, rank 0 reports (errors from any rank)."""
    try:
        torch.set_num_threads(1)
        from engine.distributed import parallel_state as ps
        from engine.model_executor import model_runner

        model_runner.CHECK_TP_SAMPLING = True  # the debug assertion: sampled ids equal on all ranks
        ps.init_distributed_environment(rank, TP, f"tcp://127.0.0.1:{port}", "cpu")
        results = {name: (_embed if name == EMBEDDING_MODEL else _run_model)(path, TP)
                   for name, path in paths.items()}
        # Collective helpers of the scheduler process.
        msgs = ps.broadcast_bytes_list([b"abc", b"", b"\x00\xff" * 10] if rank == 0 else None)
        empty = ps.broadcast_bytes_list([] if rank == 0 else None)
        pool_min = ps.all_reduce_min_int(1000 + rank)
        states = ps.gather_objects_to_rank0({"rank": rank})
        if rank == 0:
            queue.put(("ok", results, msgs, empty, pool_min, states, ps.comm_stats.calls))
        ps.destroy_distributed_environment()
    except BaseException:
        queue.put(("error", rank, traceback.format_exc()))


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
    paths, _ = models
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = get_free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, paths, queue)) for r in range(TP)]
    for p in procs:
        p.start()
    try:
        result = queue.get()  # rank 0's results, or the first error of any rank
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert result[0] == "ok", f"TP rank {result[1]} failed:\n{result[2]}"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return result


# The tests on tp2_results share two spawned ranks that build every model (about a minute).
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp2_matches_tp1_and_transformers(models, tp2_results, name):
    paths, expected = models
    logits1, tokens1, _ = _run_model(paths[name], 1)
    logits2, tokens2, pool2 = tp2_results[1][name]
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
    tp2 = tp2_results[1][EMBEDDING_MODEL]
    torch.testing.assert_close(tp2, tp1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tp2, expected[EMBEDDING_MODEL], rtol=2e-5, atol=2e-5)


@pytest.mark.slow
def test_tp_collective_helpers(tp2_results):
    _, _, msgs, empty, pool_min, states, comm_calls = tp2_results
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
